"""The bf16 GEMM on AMX's tile layout (csrc/gemm_amx.c on AMX tiles, csrc/gemm_pairs.c with
AVX512_BF16 dot products where there is no AMX) and the layout itself (kernels/gemm_cpu.py).

The layout tests and the torch fallback run on every CPU (an amx-packed weight must give right
results where neither kernel runs); the kernel tests need AMX or AVX512_BF16 and are skipped
elsewhere."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu as kcpu
from kernels import gemm_cpu

BF, F32 = torch.bfloat16, torch.float32
needs_amx = pytest.mark.skipif(not gemm_cpu.amx_layout_ready(),
                               reason="this CPU (or its OS, or QWORKER_CPU_AMX=0) gives neither AMX nor AVX512_BF16")


def _case(g, M, N, K, bias_dtype=F32):
    w = torch.randn(N, K, generator=g).to(BF)
    x = torch.randn(M, K, generator=g).to(BF)
    b = None if bias_dtype is None else torch.randn(N, generator=g).to(bias_dtype)
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    return w, x, b, ref


def test_layout_round_trips_and_is_refused_where_it_cannot_hold():
    g = torch.Generator().manual_seed(0)
    for N, K in ((1, 32), (17, 64), (40, 96), (136, 576)):
        w = torch.randn(N, K, generator=g).to(BF)
        p = gemm_cpu.pack_weight(w, "amx")
        assert p.shape == (-(-N // 16), K // 2, 32) and p.dtype == BF and gemm_cpu.is_amx_packed(p)
        assert gemm_cpu.packed_k(p) == K
        assert torch.equal(gemm_cpu.unpack_weight(p, N), w)
        # element [p, k2, 2c + j] is W[16p + c, 2 k2 + j]
        assert p[0, 3, 2 * 0 + 1] == w[0, 7] and p[-1, 0, 0] == (w[16 * (p.shape[0] - 1), 0])
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm_cpu.pack_weight(torch.randn(8, 48).to(BF), "amx")
    with pytest.raises(ValueError, match="bf16"):
        gemm_cpu.pack_weight(torch.randn(8, 64), "amx")
    with pytest.raises(ValueError, match="layout"):
        gemm_cpu.pack_weight(torch.randn(8, 64), "tiles")


def test_default_layout_follows_amx_and_the_switch(monkeypatch):
    w = torch.randn(20, 64).to(BF)
    assert gemm_cpu.pack_weight(torch.randn(20, 48).to(BF)).shape[2] == 16  # K not a multiple of 32
    assert gemm_cpu.pack_weight(w.float()).shape[2] == 16  # fp32 weights
    assert gemm_cpu.is_amx_packed(gemm_cpu.pack_weight(w)) == gemm_cpu.amx_layout_ready()
    monkeypatch.setenv("QWORKER_CPU_AMX", "0")
    assert not gemm_cpu.amx_layout_ready() and gemm_cpu.pack_weight(w).shape[2] == 16


@pytest.mark.parametrize("amx_env", ["1", "0"])
def test_amx_packed_weights_are_right_on_every_path(monkeypatch, amx_env):
    """The kernel where AMX runs; the torch fallback where it is off (or missing), for fp32 x (which
    the kernel does not take: its values are used unrounded, as the panels GEMM's) and bf16 x."""
    monkeypatch.setenv("QWORKER_CPU_AMX", amx_env)
    g = torch.Generator().manual_seed(1)
    w, x, b, ref = _case(g, 5, 40, 64)
    p = gemm_cpu.pack_weight(w, "amx")
    y = gemm_cpu.gemm(x, p, b, 40, out_dtype=F32)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-4)
    x32 = torch.randn(5, 64, generator=g)
    y32 = gemm_cpu.gemm(x32, p, b, 40, out_dtype=F32)
    assert torch.allclose(y32.double(), x32.double() @ w.double().t() + b.double(), rtol=1e-5, atol=1e-4)


@needs_amx
@pytest.mark.parametrize("K", [32, 64, 576])
def test_every_tile_combination_matches_float64(K):
    """Rows 1-100 (one row tile; pairs of row tiles with an odd one left; ragged last rows) by N
    with 1-3 panels at a time, partial last panels; fp32 and bf16 outputs; every bias kind."""
    g = torch.Generator().manual_seed(K)
    for M in (1, 2, 15, 16, 17, 31, 32, 33, 47, 100):
        for N, bias_dtype in ((1, F32), (15, None), (16, BF), (17, F32), (48, F32), (49, BF), (136, None)):
            w, x, b, ref = _case(g, M, N, K, bias_dtype)
            p = gemm_cpu.pack_weight(w, "amx")
            for threads in (1, 2, 3):
                y = gemm_cpu.gemm(x, p, b, N, out_dtype=F32, threads=threads)
                err = (y.double() - ref).norm() / ref.norm()
                assert err < 1e-6, (M, N, K, threads, float(err))
                yb = gemm_cpu.gemm(x, p, b, N, threads=threads)
                assert yb.dtype == BF and torch.equal(yb, y.to(BF)), (M, N, K, threads)


@needs_amx
def test_a_row_does_not_depend_on_the_batch_or_threads():
    g = torch.Generator().manual_seed(7)
    w, x, b, _ = _case(g, 70, 136, 576)
    p = gemm_cpu.pack_weight(w, "amx")
    full = gemm_cpu.gemm(x, p, b, 136, out_dtype=F32, threads=2)
    for i in (0, 15, 16, 33, 69):
        for threads in (1, 3):
            alone = gemm_cpu.gemm(x[i:i + 1], p, b, 136, out_dtype=F32, threads=threads)
            assert torch.equal(alone[0], full[i]), (i, threads)
    for M in (16, 17, 48):
        assert torch.equal(gemm_cpu.gemm(x[:M], p, b, 136, out_dtype=F32, threads=1), full[:M])


@needs_amx
def test_strided_rows_out_and_special_values():
    g = torch.Generator().manual_seed(3)
    w, x, b, _ = _case(g, 20, 40, 64)
    p = gemm_cpu.pack_weight(w, "amx")
    want = gemm_cpu.gemm(x, p, b, 40, out_dtype=F32)
    wide = torch.randn(20, 100, generator=g).to(BF)
    wide[:, 10:74] = x
    out = torch.full((20, 64), float("nan"))[:, :40]  # rows 64 apart, poisoned
    y = gemm_cpu.gemm(wide[:, 10:74], p, b, 40, out=out, out_dtype=F32)
    assert y is out and torch.equal(out, want)
    x[3, 5] = float("nan")
    x[4, :] = 0
    yb = gemm_cpu.gemm(x, p, None, 40)
    assert (yb[3].view(torch.int16) == 0x7FC0).all()  # NaN rows as the other kernels write them
    assert (yb[4] == 0).all()


needs_pairs = pytest.mark.skipif(gemm_cpu.amx_kernel() != "avx512_bf16",
                                 reason="this CPU runs the amx layout on AMX tiles, or has no AVX512_BF16")


@needs_pairs
@pytest.mark.parametrize("K", [32, 576, 4096])
def test_pairs_kernel_gives_the_panels_dot_kernels_bits(K):
    """Without AMX, the amx layout's AVX512_BF16 kernel (csrc/gemm_pairs.c) sums the same k pairs in
    the same order as the panels layout's dot-product kernel (csrc/gemm_bf16.c, which splits K over
    blocks past 2048): every bit equal, whatever the rows, columns, bias kind, output dtype and
    threads, so the CPU bf16 mode's outputs do not depend on the layout."""
    g = torch.Generator().manual_seed(K)
    for M in (1, 4, 6, 7, 13, 48, 100):
        for N, bias_dtype in ((1, F32), (17, None), (64, BF), (136, F32), (576, None)):
            w, x, b, _ = _case(g, M, N, K, bias_dtype)
            x[0, :3] = torch.tensor([1e-40, float("inf"), -0.0])  # a denormal (read as zero), Inf, -0
            tiles, panels = gemm_cpu.pack_weight(w, "amx"), gemm_cpu.pack_weight(w, "panels")
            for odt in (F32, BF):
                for threads in (1, 2, 3):
                    a = gemm_cpu.gemm(x, tiles, b, N, out_dtype=odt, threads=threads)
                    c = gemm_cpu.gemm(x, panels, b, N, out_dtype=odt, threads=threads)
                    bits = torch.int16 if odt == BF else torch.int32
                    assert torch.equal(a.view(bits), c.view(bits)), (M, N, K, odt, threads)


def test_builds_without_amx_say_so(monkeypatch):
    """Only the avx512 build on an AMX or AVX512_BF16 CPU runs the amx layout; every other build
    says it does not and refuses the call before reading anything."""
    monkeypatch.delenv("QWORKER_CPU_AMX", raising=False)
    for isa in kcpu.available_isas():
        lib = kcpu._library_for(isa)
        if lib is None or (isa == "avx512" and gemm_cpu.amx_layout_usable(lib)):
            continue
        assert lib.qw_gemm_bf16_amx_ready() == 0, isa
        assert lib.qw_gemm_bf16_amx(None, 64, 1, None, None, 0, None, 8, 0, 1, 8, 64, 1, 0, 0, 0) == -3, isa
