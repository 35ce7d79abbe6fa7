"""Triton paged prefill/extend attention and the paged_attention router.

Batches mix decode rows (q_len 1), whole prompts (q_len == seq_len) and
chunks after a cached prefix (q_len < seq_len), over shuffled pages with
NaN in every slot no sequence owns, into a NaN-poisoned output.
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

from kernels import paged_attention, paged_attention_ref, paged_prefill_attention, paged_prefill_attention_ref

CASES = [  # (block_size, Hkv, G, D, block_m, block_n)
    (16, 2, 3, 64, 16, 16),  # several query and key tiles per sequence
    (16, 1, 8, 64, 16, 32),
    (32, 2, 4, 64, 32, 16),
    (16, 3, 1, 64, 64, 64),  # the default tile sizes
    (32, 1, 3, 128, 16, 32),
]


def _mixed(gen: torch.Generator, lens: list[int]) -> list[int]:
    """Decode row, whole prompt, and a chunk after a cached prefix, in random order."""
    q_lens = []
    for i, L in enumerate(lens):
        kind = (i + int(torch.randint(0, 3, (1,), generator=gen))) % 3
        q_lens.append(1 if kind == 0 else L if kind == 1 else int(torch.randint(1, L + 1, (1,), generator=gen)))
    return q_lens


def _run(batch, fn=paged_prefill_attention, **kw):
    out = poisoned_like(batch.q)
    res = fn(*batch.args(), out=out, **kw)
    assert res.data_ptr() == out.data_ptr()
    return out


@pytest.mark.parametrize("bs,hkv,g,d,block_m,block_n", CASES)
def test_prefill_matches_reference(seed, device, bs, hkv, g, d, block_m, block_n):
    gen = generator(seed)
    lens = random_lens(gen, 4, bs, 3 * bs + 7)
    q_lens = _mixed(gen, lens)
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=bs, num_kv_heads=hkv, group=g,
                             head_dim=d, dtype=torch.float32, device=device)
    out = _run(batch, block_m=block_m, block_n=block_n)
    ref = paged_prefill_attention_ref(*batch.finite().args())
    assert_close(out, ref, torch.float32, f"prefill lens={lens} q_lens={q_lens}")


def test_prefill_chunks_against_oracle(seed, device):
    """Chunked prefill after prefix hits, chunks ending mid-block, plus a one-token sequence."""
    gen = generator(seed)
    lens, q_lens = [45, 1, 32, 19], [13, 1, 16, 18]
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=16, num_kv_heads=2, group=2,
                             head_dim=64, dtype=torch.float32, device=device)
    out = _run(batch, block_m=16, block_n=16)
    assert_close(out, oracle_attention(batch).float(), torch.float32, "chunks vs oracle")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision(seed, device, dtype):
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("bf16 is not supported by Triton's CPU interpreter (numpy has no bfloat16)")
    gen = generator(seed)
    lens = random_lens(gen, 3, 16, 40)
    q_lens = _mixed(gen, lens)
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=16, num_kv_heads=2, group=4,
                             head_dim=64, dtype=dtype, device=device)
    out = _run(batch, block_m=16, block_n=32)
    ref = paged_prefill_attention_ref(*batch.finite().args())
    assert_close(out, ref, dtype, f"prefill {dtype} lens={lens} q_lens={q_lens}")


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_paged_attention_routes(seed, device, kind):
    gen = generator(seed)
    lens = random_lens(gen, 4, 16, 45)
    q_lens = [1] * 4 if kind == "decode" else [1, lens[1], 1, max(1, lens[3] // 2)]
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=16, num_kv_heads=3, group=3,
                             head_dim=64, dtype=torch.float32, device=device)
    out = _run(batch, fn=paged_attention)
    ref = paged_attention_ref(*batch.finite().args())
    assert_close(out, ref, torch.float32, f"paged_attention {kind} lens={lens} q_lens={q_lens}")
