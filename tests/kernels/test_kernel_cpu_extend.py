"""The CPU engine's C extend (prefill) kernel against the per-token float64 oracle and the torch
reference, under every vector ISA build this CPU runs (others are skipped with the reason).

Batches mix decode rows (one query), whole prompts and prefix-hit chunks (queries starting
mid-sequence); unowned cache slots and table padding are NaN/garbage, and under a window the
blocks wholly before it are NaN too: any read outside what a query may see, or any output left
unwritten, shows up as NaN.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from cpu_isa import isa  # noqa: F401  (fixture)
from kernel_testlib import assert_close, generator, make_paged_batch, oracle_attention, poison_before_window, poisoned_like

import kernels
from kernels import cpu as kcpu
from qworker.model.attention import AttentionMetadata, PagedAttention

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")


@pytest.fixture
def no_fallback(monkeypatch):
    """The reference may not run: a kernel that silently fell back would pass the accuracy checks."""
    def refuse(*a, **k):
        raise AssertionError("the extend kernel fell back to the torch reference")
    monkeypatch.setattr(kcpu, "paged_prefill_attention_ref", refuse)


CASES = [  # (block_size, Hkv, G, D, lens, q_lens)
    (16, 3, 3, 64, [1, 20, 37, 70], [1, 20, 9, 33]),  # SmolLM2's shape: decode row, prompt, prefix hits
    (16, 2, 1, 64, [48, 5], [48, 5]),  # whole prompts ending on and before a block edge
    (32, 1, 8, 128, [65, 40], [30, 40]),  # G 8, D 128
    (16, 2, 4, 72, [50, 17], [50, 2]),  # D not a multiple of 16 (vector tails)
    (8, 2, 2, 64, [75], [75]),  # more than one query tile, chunk edges off the block edges
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bs,hkv,g,d,lens,q_lens", CASES)
def test_matches_oracle(seed, isa, no_fallback, bs, hkv, g, d, lens, q_lens, cache_dtype):
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=bs, num_kv_heads=hkv, group=g, head_dim=d,
                             dtype=torch.float32, device="cpu")
    batch = type(batch)(**{**batch.__dict__, "k_cache": batch.k_cache.to(cache_dtype), "v_cache": batch.v_cache.to(cache_dtype)})
    want = oracle_attention(batch).float()  # on the cache's rounded values
    out = poisoned_like(batch.q)
    res = kernels.paged_prefill_attention_cpu(*batch.args(), out=out)
    assert res.data_ptr() == out.data_ptr()
    assert_close(out, want, torch.float32, f"cpu extend {isa} {cache_dtype} lens={lens} q_lens={q_lens}")


WINDOWS = [  # (block_size, Hkv, G, D, window, softcap)
    (16, 3, 3, 64, 5, None),  # inside one block
    (16, 2, 1, 64, 16, 3.0),  # one whole block
    (16, 2, 4, 128, 37, None),  # starts mid-page
    (32, 1, 8, 64, 1, 3.0),  # a query sees only itself
    (16, 2, 2, 64, 500, 3.0),  # over every context
    (16, 2, 2, 64, None, 3.0),  # softcap alone
    (16, 2, 2, 72, 20, 3.0),  # D 72
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,hkv,g,d,w,cap", WINDOWS)
def test_window_softcap_match_oracle(seed, isa, no_fallback, bs, hkv, g, d, w, cap, cache_dtype):
    gen = generator(seed)
    lens, q_lens = [1, 9, 3 * bs + 5, 5 * bs, 70], [1, 9, 6, 40, 1]
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=bs, num_kv_heads=hkv, group=g, head_dim=d,
                             dtype=torch.float32, device="cpu")
    batch.q.mul_(2.0)  # logits large enough for the cap to bite
    batch = type(batch)(**{**batch.__dict__, "k_cache": batch.k_cache.to(cache_dtype), "v_cache": batch.v_cache.to(cache_dtype)})
    want = oracle_attention(batch, w, cap).float()
    if w is not None:
        batch, poisoned = poison_before_window(batch, w)
        assert poisoned > 0 or w >= max(lens)
    out = poisoned_like(batch.q)
    kernels.paged_prefill_attention_cpu(*batch.args(), out=out, sliding_window=w, softcap=cap)
    assert_close(out, want, torch.float32, f"cpu extend {isa} W={w} cap={cap} {cache_dtype}")


@pytest.mark.parametrize("window", [None, 100])
def test_long_chunks_match_reference(seed, isa, no_fallback, window):
    """Hundreds of tokens: a whole prompt, a prefix-hit chunk, a decode row, SmolLM2's heads."""
    gen = generator(seed)
    lens, q_lens = [300, 420, 260], [300, 150, 1]
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=16, num_kv_heads=3, group=3, head_dim=64,
                             dtype=torch.float32, device="cpu")
    ref = kernels.paged_prefill_attention_ref(*batch.finite().args(), sliding_window=window, softcap=30.0)
    if window is not None:
        batch, _ = poison_before_window(batch, window)
    out = kernels.paged_prefill_attention_cpu(*batch.args(), sliding_window=window, softcap=30.0)
    assert_close(out, ref, torch.float32, f"cpu extend long {isa} W={window}")


def test_writes_only_its_rows_of_a_larger_output(seed, no_fallback):
    """The engine passes ``q[nd:]`` and ``out=out[nd:]`` of a mixed step: rows before stay untouched."""
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=[30, 19], q_lens=[12, 19], block_size=16, num_kv_heads=2, group=3, head_dim=64,
                             dtype=torch.float32, device="cpu")
    big = torch.full((35, *batch.q.shape[1:]), 7.0)
    kernels.paged_prefill_attention_cpu(*batch.args(), out=big[4:])
    assert_close(big[4:], oracle_attention(batch).float(), torch.float32, "rows of a larger output")
    assert torch.equal(big[:4], torch.full_like(big[:4], 7.0))


def test_out_of_range_block_ids_raise_before_reading(seed):
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=[40, 3], q_lens=[8, 3], block_size=16, num_kv_heads=2, group=2, head_dim=64,
                             dtype=torch.float32, device="cpu")
    bad = batch.block_tables.clone()
    bad[0, 1] = batch.k_cache.shape[0] + 5
    args = list(batch.args())
    args[3] = bad
    with pytest.raises(IndexError):
        kernels.paged_prefill_attention_cpu(*args)


def test_switched_off_runs_the_reference(seed, monkeypatch):
    """EXTEND_KERNEL = False (what QWORKER_CPU_EXTEND=0 sets) takes the reference, and the C kernel
    agrees with it on the same (finite) batch."""
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=[50, 21], q_lens=[50, 4], block_size=16, num_kv_heads=3, group=3, head_dim=64,
                             dtype=torch.float32, device="cpu").finite()
    calls = []
    real = kcpu.paged_prefill_attention_ref
    monkeypatch.setattr(kcpu, "paged_prefill_attention_ref", lambda *a, **k: calls.append(1) or real(*a, **k))
    c = kernels.paged_prefill_attention_cpu(*batch.args())
    assert not calls
    monkeypatch.setattr(kcpu, "EXTEND_KERNEL", False)
    ref = kernels.paged_prefill_attention_cpu(*batch.args())
    assert calls == [1]
    assert_close(c, ref, torch.float32, "kernel vs reference")


@pytest.mark.parametrize("window,cap", [(None, None), (24, 5.0)])
def test_paged_attention_cpu_backend_mixed_step(seed, isa, no_fallback, window, cap):
    """PagedAttention("cpu") on a mixed step (two decodes first, then a prompt and a prefix-hit chunk):
    the store, the decode kernel and the extend kernel together equal the per-token oracle."""
    gen = generator(seed)
    lens, q_lens = [33, 7, 40, 61], [1, 1, 40, 13]
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=16, num_kv_heads=3, group=3, head_dim=64,
                             dtype=torch.float32, device="cpu")
    want = oracle_attention(batch, window, cap).float()
    # the step's own K/V rows: take them out of the cache and let the layer write them back
    slots, keys, vals = [], [], []
    for table, L, ql in zip(batch.tables, lens, q_lens):
        for pos in range(L - ql, L):
            blk, off = table[pos // 16], pos % 16
            slots.append(blk * 16 + off)
            keys.append(batch.k_cache[blk, off].clone())
            vals.append(batch.v_cache[blk, off].clone())
            batch.k_cache[blk, off] = float("nan")
            batch.v_cache[blk, off] = float("nan")
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=batch.block_tables,
                             query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, max_query_len=max(q_lens),
                             num_decodes=2)
    layer = PagedAttention("cpu", batch.scale, sliding_window=window, softcap=cap)
    out = layer(batch.q, torch.stack(keys), torch.stack(vals), batch.k_cache, batch.v_cache, meta)
    assert_close(out, want, torch.float32, f"PagedAttention cpu {isa} W={window} cap={cap}")


@pytest.mark.parametrize("d", [16, 72, 96, 128])
def test_a_rows_bits_do_not_depend_on_where_its_prompt_was_cut(isa, no_fallback, d):
    """README's promise: a position's result follows from the position alone, however the
    scheduler cut the prompt (helper-87: head dims not a multiple of 64 sent the columns past the
    last 64 through a scalar tail whose rounding moved with the item's rows)."""
    gen = torch.Generator().manual_seed(d)
    bs, hkv, hq, L = 16, 2, 4, 150
    nb = L // bs + 1
    k, v = torch.randn(nb, bs, hkv, d, generator=gen), torch.randn(nb, bs, hkv, d, generator=gen)
    q = torch.randn(L, hq, d, generator=gen)
    table = torch.arange(nb, dtype=torch.int32).unsqueeze(0)

    def rows_from(start: int) -> torch.Tensor:
        return kcpu.paged_prefill_attention_cpu(q[start:].contiguous(), k, v, table, torch.tensor([0, L - start], dtype=torch.int32),
                                                torch.tensor([L], dtype=torch.int32), d ** -0.5, L - start)

    whole = rows_from(0)
    for start in range(1, L - 1, 7):
        assert torch.equal(rows_from(start), whole[start:]), f"{isa} D={d}: rows from {start} differ from the whole prompt's"
