"""The AMX GEMM's fused epilogues (csrc/gemm_amx.c), each against the GEMM's bf16 output and the
separate kernel it replaces, on every shape and thread count, with non-finite and huge values in
the products, and each declining (-3, the caller then makes the separate calls) exactly where it
does not apply:
  ``qw_gemm_bf16_amx_swiglu``: the gate/up product with SwiGLU, bit for bit ``qw_silu_mul_bf16``;
  ``qw_gemm_bf16_amx_argmax``: each row's argmax (the LM head's greedy token), torch.argmax's on
  the bf16 product: first index of the maximum, first NaN, all -inf rows, ties.
The kernel tests need AMX tiles (real, or the emulated build of tests/kernels/test_amx_emulation.py)
and are skipped elsewhere."""

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


def _product(lib, x, wp, M, N, K, threads):
    """The GEMM's bf16 output [M, N]."""
    y = torch.empty(M, N, dtype=BF)
    assert lib.qw_gemm_bf16_amx(x.data_ptr(), x.stride(0), 1, wp.data_ptr(), None, 0, y.data_ptr(), N, 1,
                                M, N, K, threads, 0, 0, 0) == 0
    return y


def _two_calls(lib, x, wp, M, I, K, threads):
    gu = _product(lib, x, wp, M, 2 * I, K, threads)
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


def _argmax(lib, x, wp, M, N, K, threads):
    out = torch.full((M,), -7, dtype=torch.int64)
    assert lib.qw_gemm_bf16_amx_argmax(x.data_ptr(), x.stride(0), wp.data_ptr(), M, N, K, out.data_ptr(), threads) == 0
    return out


@needs_amx
@needs_lib
def test_argmax_is_torchs_on_the_bf16_product():
    lib, _ = _libs()
    rng = random.Random(11)
    g = torch.Generator().manual_seed(11)
    for case in range(60):
        M = rng.choice([1, 2, 15, 16, 17, 33, 64, 130])
        N = rng.choice([1, 7, 16, 17, 33, 100, 1000, 4099])
        K = rng.choice([32, 64, 576])
        w = torch.randn(N, K, generator=g) * 0.1
        x = torch.randn(M, K, generator=g)
        kind = case % 6
        if kind == 1:
            w.zero_()  # every logit 0: the first column
        elif kind == 2:
            w = (w * 8).round() / 8  # many ties once rounded to bf16
        elif kind == 3:
            w[rng.randrange(N)] = float("nan")  # a NaN column
            x[rng.randrange(M)] = float("nan")  # and a NaN row
        elif kind == 4:
            w.fill_(float("-inf"))  # all -inf rows (x > 0 in column 0, 0 elsewhere)
            x.zero_()
            x[:, 0] = 1.0
        elif kind == 5:
            w[:, 0] = float("inf")  # inf and -inf products in one sum: NaN where both meet
            w[: N // 2, 1] = float("-inf")
            x[:, :2] = 1.0
        wb, xb = w.to(BF), x.to(BF)
        wp = gemm_cpu.pack_weight(wb, "amx")
        for threads in (1, 2):
            want = _product(lib, xb, wp, M, N, K, threads).argmax(dim=-1)
            assert torch.equal(_argmax(lib, xb, wp, M, N, K, threads), want), (case, M, N, K, threads)


@needs_amx
@needs_lib
def test_argmax_never_picks_a_padding_column():
    """N not a multiple of 16: the packed panel's padding columns are zero weights (logit 0), which
    would beat an all-negative row if they were looked at."""
    lib, _ = _libs()
    N, K, M = 20, 64, 5
    wp = gemm_cpu.pack_weight(-torch.ones(N, K, dtype=BF), "amx")
    x = torch.ones(M, K, dtype=BF)
    assert _argmax(lib, x, wp, M, N, K, 2).tolist() == [0] * M
    assert gemm_cpu.argmax_bf16(x, wp, N).tolist() == [0] * M


@needs_lib
def test_argmax_declines_what_it_does_not_cover():
    lib, _ = _libs()
    fn = lib.qw_gemm_bf16_amx_argmax
    x = torch.zeros(4, 64, dtype=BF)
    wp = gemm_cpu.pack_weight(torch.zeros(32, 64, dtype=BF), "amx")
    out = torch.zeros(4, dtype=torch.int64)
    assert fn(x.data_ptr(), 64, wp.data_ptr(), 4, 32, 0, out.data_ptr(), 1) == -3  # K = 0
    assert fn(x.data_ptr(), 64, wp.data_ptr(), 4, 32, 48, out.data_ptr(), 1) == -1  # K % 32
    assert fn(x.data_ptr(), 32, wp.data_ptr(), 4, 32, 64, out.data_ptr(), 1) == -1  # ldx < K
    assert fn(x.data_ptr(), 64, wp.data_ptr(), 4, 0, 64, out.data_ptr(), 1) == -1  # no columns
    rc = fn(x.data_ptr(), 64, wp.data_ptr(), 4, 32, 64, out.data_ptr(), 1)
    assert rc == (0 if gemm_cpu.amx_kernel() == "amx" else -3)
    assert (gemm_cpu.argmax_bf16(x, wp, 32) is None) == (gemm_cpu.amx_kernel() != "amx")
