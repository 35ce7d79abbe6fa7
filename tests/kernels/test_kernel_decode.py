"""Triton paged decode attention against its reference (and the oracle).

On CPU this runs under TRITON_INTERPRET=1, so shapes are tiny: a few
sequences of at most a few blocks. Unowned cache slots are NaN, so any read
outside a sequence's pages poisons the output; the output is NaN-poisoned
before the call, so any element left unwritten fails.
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
    poisoned_like,
    random_lens,
)

from kernels import paged_decode_attention, paged_decode_attention_ref

CASES = [  # (block_size, Hkv, G, D, block_n, num_splits)
    (16, 2, 3, 64, 16, None),  # auto splits, several tiles per split
    (16, 1, 8, 64, 32, 3),
    (32, 2, 4, 64, 32, 2),
    (16, 4, 1, 64, 16, 16),  # more splits than most sequences have tiles: empty splits
    (32, 1, 3, 128, 16, 1),  # single split: stage 1 writes the output directly
    (16, 2, 4, 128, 64, None),
]


def _run(batch, **kw):
    out = poisoned_like(batch.q)
    res = paged_decode_attention(*batch.decode_args(), out=out, **kw)
    assert res.data_ptr() == out.data_ptr()
    return out


@pytest.mark.parametrize("bs,hkv,g,d,block_n,splits", CASES)
def test_decode_matches_reference(seed, device, bs, hkv, g, d, block_n, splits):
    gen = generator(seed)
    lens = random_lens(gen, 4, bs, 4 * bs + 3)
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=bs, num_kv_heads=hkv,
                             group=g, head_dim=d, dtype=torch.float32, device=device)
    out = _run(batch, num_splits=splits, block_n=block_n)
    ref = paged_decode_attention_ref(*batch.finite().decode_args())
    assert_close(out, ref, torch.float32, f"decode lens={lens} splits={splits}")


def test_decode_matches_oracle_one_token_contexts(seed, device):
    """All contexts of one token, many splits: every split but the first is empty."""
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=[1, 1, 2], q_lens=[1, 1, 1], block_size=16, num_kv_heads=2, group=3,
                             head_dim=64, dtype=torch.float32, device=device)
    out = _run(batch, num_splits=4, block_n=16)
    assert_close(out, oracle_attention(batch).float(), torch.float32, "one-token contexts")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(seed, device, dtype):
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("bf16 is not supported by Triton's CPU interpreter (numpy has no bfloat16)")
    gen = generator(seed)
    lens = random_lens(gen, 3, 16, 70)
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * 3, block_size=16, num_kv_heads=2, group=4,
                             head_dim=64, dtype=dtype, device=device)
    out = _run(batch, block_n=32)
    assert out.dtype == dtype
    ref = paged_decode_attention_ref(*batch.finite().decode_args())
    assert_close(out, ref, dtype, f"decode {dtype} lens={lens}")


def test_auto_splits_fill_the_machine():
    from kernels.decode_attention import MAX_SPLITS, choose_num_splits

    cpu = torch.device("cpu")
    assert choose_num_splits(64, 8, 2048, 64, cpu) == 1  # a big batch needs no split
    assert choose_num_splits(1, 1, 32768, 64, cpu) == 16  # 4 programs per (pretend) SM, 4 SMs
    assert choose_num_splits(1, 1, 40, 64, cpu) == 1  # never more splits than tiles
    assert choose_num_splits(1, 1, 10**7, 16, cpu) <= MAX_SPLITS
