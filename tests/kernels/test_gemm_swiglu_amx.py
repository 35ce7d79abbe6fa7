"""The gate/up GEMM with SwiGLU in its epilogue (csrc/gemm_amx.c ``qw_gemm_bf16_amx_swiglu``): bit
for bit the AMX GEMM's bf16 ``[M, 2I]`` output followed by ``qw_silu_mul_bf16``, on every shape and
thread count, with non-finite and huge values in the products; and it declines (-3, the caller then
makes the two calls) exactly where it does not apply. The bit tests need AMX tiles (real, or the
emulated build of tests/kernels/test_amx_emulation.py) and are skipped elsewhere."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu as kcpu
from kernels import gemm_cpu

BF = torch.bfloat16


def _libs():
    lib = gemm_cpu._gemm_library(BF)
    fused = getattr(lib, "qw_gemm_bf16_amx_swiglu", None) if lib is not None else None
    return lib, fused


needs_amx = pytest.mark.skipif(gemm_cpu.amx_kernel() != "amx", reason="needs AMX tiles (this CPU or OS has none)")
needs_lib = pytest.mark.skipif(_libs()[1] is None, reason="the C GEMM library does not build here")


def _two_calls(lib, x, wp, M, I, K, threads):
    gu = torch.empty(M, 2 * I, dtype=BF)
    assert lib.qw_gemm_bf16_amx(x.data_ptr(), x.stride(0), 1, wp.data_ptr(), None, 0, gu.data_ptr(), 2 * I, 1,
                                M, 2 * I, K, threads, 0, 0, 0) == 0
    act = torch.empty(M, I, dtype=BF)
    kcpu._library().qw_silu_mul_bf16(gu.data_ptr(), act.data_ptr(), M, I, threads)
    return act


def _fused(fused, x, wp, M, I, K, threads, ld=None):
    ld = ld or I
    act = torch.full((M, ld), 7.0, dtype=BF)
    assert fused(x.data_ptr(), x.stride(0), wp.data_ptr(), act.data_ptr(), ld, M, I, K, threads) == 0
    return act


@needs_amx
@needs_lib
def test_fused_is_the_two_calls_bit_for_bit():
    lib, fused = _libs()
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    shapes = [(1, 16, 32), (16, 48, 64), (17, 160, 96), (33, 1536, 576), (100, 32, 1536), (300, 64, 64)]
    shapes += [(rng.choice([2, 15, 31, 32, 48, 65, 129]), 16 * rng.randint(1, 12), 32 * rng.randint(1, 8)) for _ in range(10)]
    for M, I, K in shapes:
        w = torch.randn(2 * I, K, generator=g) * 0.3
        x = torch.randn(M, K, generator=g) * 2
        # non-finite and huge sums, in gate columns and up columns, and a gate below -87
        w[0, 0], w[1, 1], w[I, 0] = float("inf"), float("nan"), float("-inf")
        x[0, 0] = 3e38
        w[min(2, 2 * I - 1)] = -50.0
        wp = gemm_cpu.pack_weight(w.to(BF), "amx")
        xb = x.to(BF)
        for threads in (1, 2):
            want = _two_calls(lib, xb, wp, M, I, K, threads)
            got = _fused(fused, xb, wp, M, I, K, threads)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (M, I, K, threads)


@needs_amx
@needs_lib
def test_fused_reads_and_writes_strided_rows_only_where_told():
    lib, fused = _libs()
    g = torch.Generator().manual_seed(5)
    M, I, K = 37, 48, 96
    wp = gemm_cpu.pack_weight((torch.randn(2 * I, K, generator=g) * 0.3).to(BF), "amx")
    wide = torch.randn(M, K + 64, generator=g).to(BF)
    x = wide[:, 32:32 + K]  # rows K + 64 apart
    got = _fused(fused, x, wp, M, I, K, 2, ld=I + 16)
    want = _two_calls(lib, x.contiguous(), wp, M, I, K, 2)
    assert torch.equal(got[:, :I].view(torch.int16), want.view(torch.int16))
    assert bool((got[:, I:] == 7.0).all())  # the columns past I are not written


@needs_lib
def test_fused_declines_what_it_does_not_cover():
    _, fused = _libs()
    x = torch.zeros(4, 64, dtype=BF)
    wp = gemm_cpu.pack_weight(torch.zeros(2 * 24, 64, dtype=BF), "amx")
    act = torch.zeros(4, 32, dtype=BF)
    # I not a multiple of 16: a panel would hold gate and up columns
    assert fused(x.data_ptr(), 64, wp.data_ptr(), act.data_ptr(), 32, 4, 24, 64, 1) == -3
    assert fused(x.data_ptr(), 64, wp.data_ptr(), act.data_ptr(), 32, 4, 16, 0, 1) == -3  # K = 0
    assert fused(x.data_ptr(), 64, wp.data_ptr(), act.data_ptr(), 32, 4, 16, 48, 1) == -1  # K % 32
    assert fused(x.data_ptr(), 32, wp.data_ptr(), act.data_ptr(), 32, 4, 16, 64, 1) == -1  # ldx < K
    assert fused(x.data_ptr(), 64, wp.data_ptr(), act.data_ptr(), 8, 4, 16, 64, 1) == -1  # ldy < I
    assert fused(x.data_ptr(), 64, wp.data_ptr(), act.data_ptr(), 32, -1, 16, 64, 1) == -1
    rc = fused(x.data_ptr(), 64, wp.data_ptr(), act.data_ptr(), 32, 4, 16, 64, 1)
    assert rc == (0 if gemm_cpu.amx_kernel() == "amx" else -3)
