"""Adversarial checks of the bf16 GEMM on AMX tiles (csrc/gemm_amx.c, kernels/gemm_cpu.py).

Guard for 14a0dcb (found here independently while it was being fixed): the tile configuration.
GCC 12's ``_tile_loadconfig`` (amxtileintrin.h) is an asm whose memory operand is
``*(const void **)config``: 8 bytes. The optimizer therefore treats bytes 8-63 of a config built
on the stack (the tiles' column bytes and row counts) as never read and drops those stores wherever
the function that builds it is compiled on its own (``-fno-inline``; a non-static function in a
``-fPIC`` build). LDTILECFG then reads stack garbage (a #GP: SIGSEGV) or all-zero shapes; the
first AMX build worked only because GCC inlined ``configure_tiles``. The test compiles the source
with ``-fno-inline``.

Held under attack and kept as guards: a float64 fuzz (rows 0-300, N 0-300 with partial panels, K
0-2048, strided x with NaN in the gaps, ``out=`` rows apart inside poisoned guard rows, every bias
kind, both output dtypes, 1-5 threads): every element within the fp32 summation bound, nothing
outside ``out`` written, bf16 results the fp32 ones rounded, a row's bits independent of the batch
and the thread count; NaN/Inf placement and bf16 denormal inputs (read as zero) as the AVX512_BF16
dot-product kernel gives them; concurrent Python threads; AMX first used in a thread created
before the permission request, and OpenMP pools made before it."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from kernels import gemm_cpu

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kernels" / "csrc"
CC = os.environ.get("CC", "cc")
BF, F32 = torch.bfloat16, torch.float32
needs_amx = pytest.mark.skipif(shutil.which(CC) is None or not gemm_cpu.amx_layout_ready(),
                               reason="no C compiler, or this CPU/OS runs no kernel on the amx layout (neither AMX nor "
                                      "AVX512_BF16, or QWORKER_CPU_AMX=0)")
pytestmark = needs_amx


def _bound(x, w, b, odt):
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    mag = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    tol = (x.shape[-1] + 2) * 6e-8 * mag + (ref.abs() / 256 if odt == BF else 0) + 1e-30
    return ref, tol


@pytest.mark.skipif(gemm_cpu.amx_kernel() != "amx", reason="the tile configuration is AMX's: this CPU runs the layout with AVX512_BF16")
def test_tile_config_is_whole_when_not_inlined(tmp_path):
    """gemm_amx.c built with -fno-inline (the production flags otherwise) computes a product; run
    in a child, as the miscompiled build dies of SIGSEGV at LDTILECFG."""
    lib = tmp_path / "amx_noinline.so"
    flags = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
             "-DQW_GEMM_AVX512", "-fno-inline", f"-I{CSRC}"]
    sources = [str(CSRC / "gemm_amx.c"), str(CSRC / "gemm_pairs.c")]  # the second: where AMX is refused
    subprocess.run([CC, *flags, "-o", str(lib), *sources], check=True, capture_output=True, timeout=120)
    script = textwrap.dedent(f"""
        import ctypes, torch
        from kernels import gemm_cpu
        lib = ctypes.CDLL({str(lib)!r})
        fn = lib.qw_gemm_bf16_amx
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        g = torch.Generator().manual_seed(0)
        w = torch.randn(40, 64, generator=g).to(torch.bfloat16)
        x = torch.randn(20, 64, generator=g).to(torch.bfloat16)
        p = gemm_cpu.pack_weight(w, "amx")
        y = torch.empty(20, 40)
        rc = fn(x.data_ptr(), 64, 1, p.data_ptr(), None, 0, y.data_ptr(), 40, 0, 20, 40, 64, 1, 0, 0, 0)
        print(rc, float((y.double() - x.double() @ w.double().t()).abs().max()))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"the -fno-inline build died (status {out.returncode}): {out.stderr[-800:]}"
    rc, err = out.stdout.split()
    assert int(rc) == 0 and float(err) < 1e-4


def test_fuzz_against_float64_with_guards():
    rng = random.Random(20261204)
    g = torch.Generator().manual_seed(4)
    for _ in range(60):
        M, N = rng.randrange(0, 301), rng.randrange(0, 301)
        K = 32 * (rng.randrange(0, 65) if rng.random() < 0.25 else rng.randrange(0, 20))
        threads, odt, bk = rng.randrange(1, 6), rng.choice([F32, BF]), rng.choice([None, F32, BF])
        case = dict(M=M, N=N, K=K, threads=threads, odt=odt, bias=bk)
        w = torch.randn(N, K, generator=g).to(BF)
        p = gemm_cpu.pack_weight(w, "amx")
        xbuf = torch.full((M, K + rng.choice([0, 1, 7, 32])), float("nan"), dtype=BF)  # NaN in the row gaps
        x = xbuf[:, :K]
        x.copy_(torch.randn(M, K, generator=g).to(BF))
        b = None if bk is None else torch.randn(N, generator=g).to(bk)
        ybuf = torch.full((M + 2, N + rng.choice([0, 3, 16])), float("nan") if odt == F32 else -12345.0, dtype=odt)
        before = ybuf.clone()
        out = ybuf[1:M + 1, :N]
        y = gemm_cpu.gemm(x, p, b, N, out=out, out_dtype=odt, threads=threads)
        assert y is out
        ref, tol = _bound(x, w, b, odt)
        assert bool(((y.double() - ref).abs() <= tol).all()), case
        outside = torch.ones(ybuf.shape, dtype=torch.bool)
        outside[1:M + 1, :N] = False
        ibits = torch.int16 if odt == BF else torch.int32
        assert torch.equal(ybuf.view(ibits)[outside], before.view(ibits)[outside]), f"wrote outside out: {case}"
        if M and N:
            y32 = gemm_cpu.gemm(x, p, b, N, out_dtype=F32, threads=threads)
            yb = gemm_cpu.gemm(x, p, b, N, out_dtype=BF, threads=rng.randrange(1, 6))
            assert torch.equal(yb.view(torch.int16), y32.to(BF).view(torch.int16)), case
            i = rng.randrange(M)
            one = gemm_cpu.gemm(x[i:i + 1], p, b, N, out_dtype=F32, threads=rng.randrange(1, 6))
            assert torch.equal(one[0].view(torch.int32), y32[i].view(torch.int32)), (case, i)
            m2 = rng.randrange(i + 1, M + 1)
            head = gemm_cpu.gemm(x[:m2], p, b, N, out_dtype=F32, threads=rng.randrange(1, 6))
            assert torch.equal(head.view(torch.int32), y32[:m2].view(torch.int32)), (case, m2)


@pytest.mark.skipif(gemm_cpu.kernel_isa(BF) != 2, reason="no AVX512_BF16 dot-product kernel to compare with")
def test_special_values_as_the_dot_kernel_gives_them():
    g = torch.Generator().manual_seed(5)
    M, N, K = 37, 70, 96
    w = torch.randn(N, K, generator=g).to(BF)
    w[7] = 1e30
    x = torch.randn(M, K, generator=g).to(BF)
    x[0, 3] = float("nan")
    x[1, 4] = float("inf")
    x[2, 5] = -float("inf")
    x[4, 0], x[4, 1] = float("inf"), -float("inf")
    x[5] = 1e-39  # bf16 denormals: both kernels' instructions read them as zero
    x[6] = 0
    x[6, 0] = 1e-39
    finite_x = torch.where(x.isfinite(), x, torch.zeros_like(x)).double()
    mag = finite_x.abs() @ w.double().abs().t()
    for odt in (F32, BF):
        ya = gemm_cpu.gemm(x, gemm_cpu.pack_weight(w, "amx"), None, N, out_dtype=odt).float()
        yd = gemm_cpu.gemm(x, gemm_cpu.pack_weight(w, "panels"), None, N, out_dtype=odt).float()
        assert torch.equal(ya.isnan(), yd.isnan()) and torch.equal(ya.isinf(), yd.isinf())
        assert torch.equal(ya[ya.isinf()], yd[yd.isinf()])
        assert (ya[5:7] == 0).all() and (yd[5:7] == 0).all()
        fin = ya.isfinite()
        tol = 2 * (K + 2) * 6e-8 * mag + (ya.double().abs() / 128 if odt == BF else 0)
        assert bool(((ya.double() - yd.double()).abs()[fin] <= tol[fin]).all()), odt
        if odt == BF:  # NaN rows as the other kernels write them
            assert (gemm_cpu.gemm(x, gemm_cpu.pack_weight(w, "amx"), None, N)[0].view(torch.int16) == 0x7FC0).all()


def test_zero_sizes_views_and_fallbacks():
    g = torch.Generator().manual_seed(9)
    for M, N, K in ((0, 20, 64), (3, 0, 64), (3, 20, 0), (0, 0, 0), (1, 1, 32)):
        w = torch.randn(N, K, generator=g).to(BF)
        x = torch.randn(M, K, generator=g).to(BF)
        b = torch.randn(N, generator=g)
        y = gemm_cpu.gemm(x, gemm_cpu.pack_weight(w, "amx"), b, N, out_dtype=F32)
        assert y.shape == (M, N) and torch.allclose(y.double(), x.double() @ w.double().t() + b.double(), atol=1e-4)
    w = torch.randn(40, 64, generator=g).to(BF)
    p = gemm_cpu.pack_weight(w, "amx")
    wide = torch.zeros(p.shape[0], p.shape[1], 64, dtype=BF)
    wide[..., :32] = p
    views = {"3-D x": torch.randn(2, 3, 64, generator=g).to(BF), "x.t()": torch.randn(64, 5, generator=g).to(BF).t(),
             "expanded x": torch.randn(1, 64, generator=g).to(BF).expand(7, 64), "fp32 x": torch.randn(5, 64, generator=g)}
    for label, x in views.items():
        want = x.double() @ w.double().t()
        assert torch.allclose(gemm_cpu.gemm(x, p, None, 40, out_dtype=F32).double(), want, atol=1e-4), label
        assert torch.allclose(gemm_cpu.gemm(x, wide[..., :32], None, 40, out_dtype=F32).double(), want, atol=1e-4), label


def test_concurrent_python_threads_give_the_same_bits():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 512, generator=g).to(BF)
    p = gemm_cpu.pack_weight(w, "amx")
    xs = [torch.randn(m, 512, generator=g).to(BF) for m in (1, 16, 17, 48, 100)]
    want = [gemm_cpu.gemm(x, p, None, 200, out_dtype=F32, threads=1) for x in xs]
    errors = []

    def worker(seed):
        r = random.Random(seed)
        try:
            for _ in range(40):
                i = r.randrange(len(xs))
                if not torch.equal(gemm_cpu.gemm(xs[i], p, None, 200, out_dtype=F32, threads=r.randrange(1, 4)), want[i]):
                    errors.append((seed, i))
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("first", ["main", "thread"])
def test_first_amx_use_in_any_thread(first):
    """In a fresh process: an OpenMP pool and a second thread exist before AMX is asked for; the
    permission (process-wide) then serves every thread, whichever asked."""
    script = textwrap.dedent(f"""
        import threading, torch
        from kernels import gemm_cpu
        w = torch.randn(64, 256).to(torch.bfloat16); x = torch.randn(40, 256).to(torch.bfloat16)
        ref = x.double() @ w.double().t()
        gemm_cpu.gemm(x, gemm_cpu.pack_weight(w, "panels"), None, 64, threads=2)
        go, errs = threading.Event(), []
        def amx():
            y = gemm_cpu.gemm(x, gemm_cpu.pack_weight(w, "amx"), None, 64, out_dtype=torch.float32, threads=2)
            errs.append(float((y.double() - ref).abs().max()))
        t = threading.Thread(target=lambda: (go.wait(), amx())); t.start()
        if {first!r} == "main":
            amx(); go.set(); t.join()
        else:
            go.set(); t.join(); amx()
        print(max(errs), len(errs))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-800:]
    err, n = out.stdout.split()
    assert float(err) < 1e-4 and int(n) == 2
