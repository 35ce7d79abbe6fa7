"""Sliding window and soft-capping in the Triton decode and prefill kernels (the interpreter on CPU).

Every block wholly before a sequence's window is NaN-poisoned on top of the usual poisoning of
unowned slots: a kernel that reads one (instead of skipping it) returns NaN. Shapes are tiny.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import (
    ON_CUDA,
    assert_close,
    generator,
    make_paged_batch,
    oracle_attention,
    poison_before_window,
    poisoned_like,
)

from kernels import paged_attention, paged_decode_attention, paged_prefill_attention

# (block_size, Hkv, G, D, window, softcap, num_splits)
DECODE = [
    (4, 2, 2, 16, 6, None, None),  # window over several tiles, not a multiple of the block
    (4, 1, 4, 16, 3, 2.5, 4),  # window under a block, more splits than the window needs
    (8, 2, 1, 32, 8, None, 2),  # window of exactly one block
    (4, 2, 2, 16, 100, 2.5, 3),  # window over every context: plain attention (capped)
    (4, 1, 2, 16, None, 2.5, 2),  # softcap alone
]


@pytest.mark.parametrize("bs,hkv,g,d,w,cap,splits", DECODE)
def test_decode_window_softcap(seed, device, bs, hkv, g, d, w, cap, splits):
    gen = generator(seed)
    lens = [1, 5, 17, 26, 13]
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=bs, num_kv_heads=hkv, group=g,
                             head_dim=d, dtype=torch.float32, device=device)
    batch.q.mul_(2.0)
    want = oracle_attention(batch, w, cap).float()
    if w is not None:
        batch, poisoned = poison_before_window(batch, w)
        assert poisoned > 0 or w >= max(lens)
    out = poisoned_like(batch.q)
    paged_decode_attention(*batch.decode_args(), splits, out=out, block_n=16, sliding_window=w, softcap=cap)
    assert_close(out, want, torch.float32, f"decode W={w} cap={cap} lens={lens}")


# (block_size, Hkv, G, D, window, softcap, block_m, block_n)
PREFILL = [
    (4, 2, 2, 16, 5, None, 16, 16),  # window smaller than a query tile: rows see disjoint key ranges
    (4, 1, 3, 16, 11, 2.5, 16, 16),
    (8, 2, 1, 32, 16, None, 16, 32),  # window a multiple of the block
    (4, 2, 2, 16, 64, 2.5, 16, 16),  # window over every context
    (4, 2, 2, 16, None, 2.5, 16, 16),  # softcap alone
]


@pytest.mark.parametrize("bs,hkv,g,d,w,cap,block_m,block_n", PREFILL)
def test_prefill_window_softcap_mixed_step(seed, device, bs, hkv, g, d, w, cap, block_m, block_n):
    """A mixed step: decode rows, a whole prompt, chunks after a cached prefix (one mid-block)."""
    gen = generator(seed)
    lens, q_lens = [37, 1, 22, 29, 9], [1, 1, 22, 6, 9]
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=bs, num_kv_heads=hkv, group=g,
                             head_dim=d, dtype=torch.float32, device=device)
    batch.q.mul_(2.0)
    want = oracle_attention(batch, w, cap).float()
    if w is not None:
        batch, _ = poison_before_window(batch, w)
    out = poisoned_like(batch.q)
    paged_prefill_attention(*batch.args(), out=out, block_m=block_m, block_n=block_n, sliding_window=w, softcap=cap)
    assert_close(out, want, torch.float32, f"prefill W={w} cap={cap}")
    routed = poisoned_like(batch.q)
    paged_attention(*batch.args(), out=routed, sliding_window=w, softcap=cap)
    assert_close(routed, want, torch.float32, f"paged_attention W={w} cap={cap}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_window_half_precision(seed, device, dtype):
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("bf16 is not supported by Triton's CPU interpreter (numpy has no bfloat16)")
    gen = generator(seed)
    lens, q_lens = [30, 19, 9], [1, 7, 9]
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=4, num_kv_heads=2, group=2, head_dim=16,
                             dtype=dtype, device=device)
    want = oracle_attention(batch, 7, 4.0)
    batch, _ = poison_before_window(batch, 7)
    out = paged_prefill_attention(*batch.args(), block_m=16, block_n=16, sliding_window=7, softcap=4.0)
    assert out.dtype == dtype
    assert_close(out, want.to(dtype), dtype, f"prefill {dtype}")
    dec = type(batch)(**{**batch.__dict__, "q": batch.q[[0]], "lens": lens[:1], "q_lens": [1],
                         "seq_lens": batch.seq_lens[:1], "block_tables": batch.block_tables[:1]})
    out = paged_decode_attention(*dec.decode_args(), 2, block_n=16, sliding_window=7, softcap=4.0)
    assert_close(out, want[:1].to(dtype), dtype, f"decode {dtype}")
