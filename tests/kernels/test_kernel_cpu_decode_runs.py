"""The C decode kernel walks a run of consecutive block ids as one page (csrc/paged_decode.c,
qw_run_length) and asks for a scattered sequence's rows ahead of its reads (qw_stream, in a copy
of the kernel of its own). Neither may change a bit: the same logical K/V, laid out in runs or
scattered over the pool, gives identical outputs, for every cache dtype, ISA build and work split,
with and without a sliding window, against the float64 oracle too."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from cpu_isa import isa  # noqa: F401  (fixture)
from kernel_testlib import generator

from kernels import paged_decode_attention_cpu, paged_decode_attention_ref

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")


def _layouts(gen, lens, bs, hkv, d, dtype):
    """The same per-sequence K/V in two pools: every sequence's blocks one after another (with a
    jump between sequences, and one sequence split into two runs), and scattered at random."""
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 3
    width = max(need)
    kv = [(torch.randn(n * bs, hkv, d, generator=gen), torch.randn(n * bs, hkv, d, generator=gen)) for n in need]
    pools = []
    for order in ("runs", "scattered"):
        if order == "runs":
            ids, at = [], 1  # block 0 stays unused: the first run does not start at the pool's start
            for i, n in enumerate(need):
                seq = list(range(at, at + n))
                if i == 0 and n > 2:  # a run broken in the middle
                    seq = seq[: n // 2] + [x + 1 for x in seq[n // 2 :]]
                    at += 1
                ids.append(seq)
                at += n
        else:
            perm = torch.randperm(nb, generator=gen).tolist()
            ids, at = [], 0
            for n in need:
                ids.append(perm[at : at + n])
                at += n
        k = torch.full((nb + 2, bs, hkv, d), float("nan"))
        v = torch.full_like(k, float("nan"))
        table = torch.full((len(lens), width), 10_000, dtype=torch.int32)  # garbage padding
        for b, (blocks, (ks, vs)) in enumerate(zip(ids, kv)):
            table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            for j, blk in enumerate(blocks):
                k[blk] = ks[j * bs : (j + 1) * bs]
                v[blk] = vs[j * bs : (j + 1) * bs]
        pools.append((k.to(dtype), v.to(dtype), table))
    return pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch,hkv,g,d,bs", [(6, 3, 3, 64, 16), (1, 3, 3, 64, 16), (5, 2, 4, 128, 16), (4, 1, 2, 32, 8)])
@pytest.mark.parametrize("window", [None, 37])
def test_runs_and_scattered_pages_give_the_same_bits(seed, isa, dtype, batch, hkv, g, d, bs, window):
    gen = generator(seed)
    lens = [int(torch.randint(1, 9 * bs, (1,), generator=gen)) for _ in range(batch)]
    lens[0] = 7 * bs + 3  # long enough for the broken run
    q = torch.randn(batch, hkv * g, d, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    pools = _layouts(gen, lens, bs, hkv, d, dtype)
    outs = [paged_decode_attention_cpu(q, k, v, table, seq_lens, d ** -0.5, sliding_window=window) for k, v, table in pools]
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[0], outs[1]), f"lens={lens}"
    k, v, table = pools[0]
    clean = table.clone()
    for b, n in enumerate(lens):
        clean[b, -(-n // bs):] = 0
    ref = paged_decode_attention_ref(q, torch.nan_to_num(k.float()), torch.nan_to_num(v.float()), clean, seq_lens,
                                     d ** -0.5, sliding_window=window)
    torch.testing.assert_close(outs[0], ref, rtol=2e-5, atol=2e-5)
