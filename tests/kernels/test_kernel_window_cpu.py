"""Sliding window and soft-capping in the CPU engine's C decode kernel, against the per-token oracle.

Blocks wholly before each sequence's window are NaN-poisoned (besides the unowned slots): the
kernel must not read them. fp32, fp16 and bf16 caches; GQA; windows under, at and over a block,
and over the whole context.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from kernel_testlib import assert_close, generator, make_paged_batch, oracle_attention, poison_before_window, poisoned_like

from kernels import cpu_kernels_available, paged_decode_attention_cpu, paged_decode_attention_ref

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")

# (block_size, Hkv, G, D, window, softcap)
CASES = [
    (16, 3, 3, 64, 5, None),  # SmolLM2's shape, a window inside one block
    (16, 2, 1, 64, 16, 3.0),  # one whole block
    (16, 2, 4, 128, 37, None),  # not a multiple of the block: starts mid-page
    (32, 1, 8, 64, 1, 3.0),  # a query sees only itself
    (16, 2, 2, 64, 500, 3.0),  # over every context
    (16, 2, 2, 64, None, 3.0),  # softcap alone
    (16, 2, 2, 72, 20, 3.0),  # D not a power of two (the generic accumulate path)
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bs,hkv,g,d,w,cap", CASES)
def test_window_softcap_matches_oracle(seed, bs, hkv, g, d, w, cap, cache_dtype):
    assert cpu_kernels_available()
    gen = generator(seed)
    lens = [1, 9, bs, bs + 3, 3 * bs + 5, 5 * bs]
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=bs, num_kv_heads=hkv, group=g,
                             head_dim=d, dtype=torch.float32, device="cpu")
    batch.q.mul_(2.0)  # logits large enough for the cap to bite
    batch = type(batch)(**{**batch.__dict__, "k_cache": batch.k_cache.to(cache_dtype),
                           "v_cache": batch.v_cache.to(cache_dtype)})
    want = oracle_attention(batch, w, cap).float()  # on the cache's rounded values
    if w is not None:
        batch, poisoned = poison_before_window(batch, w)
        assert poisoned > 0 or w >= max(lens)
    out = poisoned_like(batch.q)
    res = paged_decode_attention_cpu(*batch.decode_args(), out=out, sliding_window=w, softcap=cap)
    assert res.data_ptr() == out.data_ptr()
    assert_close(out, want, torch.float32, f"cpu decode W={w} cap={cap} {cache_dtype} lens={lens}")


def test_long_contexts_window_matches_reference(seed):
    """Hundreds of tokens, window 100, several heads per thread item and many sequences."""
    gen = generator(seed)
    lens = [int(x) for x in torch.randint(1, 700, (9,), generator=gen)] + [1, 100, 101, 16 * 30]
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=16, num_kv_heads=3, group=3,
                             head_dim=64, dtype=torch.float32, device="cpu")
    ref = paged_decode_attention_ref(*batch.finite().decode_args(), sliding_window=100, softcap=30.0)
    poisoned, _ = poison_before_window(batch, 100)
    out = paged_decode_attention_cpu(*poisoned.decode_args(), sliding_window=100, softcap=30.0)
    assert_close(out, ref, torch.float32, f"cpu decode long window lens={lens}")


def test_out_of_window_table_entries_are_not_read(seed):
    """Table entries before the window are never dereferenced, not even checked: a garbage id
    there is fine (the block manager may one day recycle those blocks)."""
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=[70, 5], q_lens=[1, 1], block_size=16, num_kv_heads=2, group=2, head_dim=64,
                             dtype=torch.float32, device="cpu")
    want = oracle_attention(batch, 20).float()
    tables = batch.block_tables.clone()
    tables[0, :3] = -7  # positions 0..47; the window of the query at 69 starts at 50
    out = paged_decode_attention_cpu(batch.q, batch.k_cache, batch.v_cache, tables, batch.seq_lens, batch.scale,
                                     sliding_window=20)
    assert_close(out, want, torch.float32, "garbage before the window")
    with pytest.raises(IndexError):  # ... while a bad id inside the window is still refused
        tables[0, 3] = -7
        paged_decode_attention_cpu(batch.q, batch.k_cache, batch.v_cache, tables, batch.seq_lens, batch.scale,
                                   sliding_window=20)
