"""The C decode kernel at head dims its vector paths are not specialised for (16-256): each ISA
build must fall back correctly. D=16 once ran the AVX-512 GQA kernel with 8 vectors per row and
overran its accumulators (heap corruption, abort in the tiny-model benchmark smoke test)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from cpu_isa import isa  # noqa: F401  (fixture)
from kernel_testlib import assert_close, generator, make_paged_batch, oracle_attention, poisoned_like, random_lens

from kernels import paged_decode_attention_cpu

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")


@pytest.mark.parametrize("d", [16, 32, 48, 80, 96, 256])
@pytest.mark.parametrize("g", [1, 2, 4])
def test_unusual_head_dims_match_oracle(seed, isa, d, g):
    gen = generator(seed)
    lens = random_lens(gen, 5, 16, 3 * 16 + 5)
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=16, num_kv_heads=2, group=g,
                             head_dim=d, dtype=torch.float32, device="cpu")
    out = poisoned_like(batch.q)
    paged_decode_attention_cpu(*batch.decode_args(), out=out)
    assert_close(out, oracle_attention(batch).float(), torch.float32, f"cpu decode {isa} D={d} G={g} lens={lens}")
