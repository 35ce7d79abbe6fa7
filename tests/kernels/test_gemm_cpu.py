"""The packed fp32 GEMM (kernels/gemm_cpu.py, csrc/gemm_f32.c): y = x @ W^T (+ bias) against a
float64 reference, under each ISA build this CPU runs, over odd shapes (row tails of every tile
size, N not a multiple of the 16-column panel, odd K), with and without bias; the torch fallback;
bad inputs; and the AVX-512 path compiled (not run) where this CPU lacks it."""

from __future__ import annotations

import os
import sys
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from cpu_isa import isa  # noqa: F401  (fixture)

from kernels import cpu as kcpu
from kernels import gemm_cpu

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")
SOURCE = Path(kcpu.__file__).with_name("csrc") / "gemm_f32.c"


def _reference(x, w, b):
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def _check(y, x, w, b):
    ref = _reference(x, w, b)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    # fp32 accumulation over K terms of unit-scale products
    tol = 1e-5 * (x.shape[-1] ** 0.5 + 1) * max(1.0, ref.abs().max().item())
    err = (y.double() - ref).abs().max().item() if y.numel() else 0.0
    assert err <= tol, f"max abs error {err} > {tol}"


# (M, N, K): every row count 1..14 (each tile height and the balanced splits), panel tails, odd K,
# a few larger M (row blocks, threads over rows), N of one column and of several panels
SHAPES = [(m, 37, 33) for m in range(1, 15)] + [
    (15, 16, 1), (17, 1, 7), (23, 100, 577), (31, 33, 64), (48, 160, 96), (64, 129, 31), (70, 47, 129), (300, 50, 75),
    (301, 17, 40), (5, 200, 1536), (1, 49, 576), (200, 16, 300), (9, 20, 900),
]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_matches_float64_under_each_isa(isa, bias):
    g = torch.Generator().manual_seed(1)
    # each build's own micro-kernel (the isa fixture pins the GEMM to the build it names)
    expected = {"avx512": 2, "avx2": 1, "generic": 0}[isa]
    assert gemm_cpu.kernel_isa() == expected
    for M, N, K in SHAPES:
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g)
        b = torch.randn(N, generator=g) if bias else None
        packed = gemm_cpu.pack_weight(w)
        assert packed.shape == (-(-N // 16), K, 16)
        for threads in (1, 2):
            _check(gemm_cpu.gemm(x, packed, b, N, threads=threads), x, w, b)


def test_cache_blocking_knobs_and_strided_rows(isa):
    """Small x blocks, weight groups and K blocks (several of each per thread; later K blocks
    accumulate into y, the tail panel too), x rows with a wider stride,
    a leading batch dimension, and a preallocated out with a wider row stride."""
    g = torch.Generator().manual_seed(2)
    M, N, K = 77, 150, 45
    w, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    packed = gemm_cpu.pack_weight(w)
    wide = torch.randn(M, K + 11, generator=g)
    x = wide[:, 3:3 + K]  # row stride K + 11, unit column stride: passed uncopied
    for mc, group, kc in [(1, 1, 0), (7, 2, 5), (13, 3, 1), (0, 0, 0), (0, 0, 44), (100, 9, 1000)]:
        _check(gemm_cpu.gemm(x, packed, b, N, mc=mc, group=group, kc=kc, threads=2), x, w, b)
    x3 = torch.randn(3, 5, K, generator=g)
    y3 = gemm_cpu.gemm(x3, packed, b, N)
    assert y3.shape == (3, 5, N)
    _check(y3.reshape(15, N), x3.reshape(15, K), w, b)
    buf = torch.full((M, N + 9), float("nan"))
    out = buf[:, :N]
    assert gemm_cpu.gemm(x, packed, b, N, out=out) is out
    _check(out, x, w, b)
    assert torch.isnan(buf[:, N:]).all()  # nothing written past the N columns


def test_non_contiguous_and_empty_inputs(isa):
    g = torch.Generator().manual_seed(3)
    N, K = 40, 24
    w = torch.randn(N, K, generator=g)
    packed = gemm_cpu.pack_weight(w)
    xt = torch.randn(K, 9, generator=g).T  # column stride != 1: copied once, still right
    _check(gemm_cpu.gemm(xt, packed, None, N), xt, w, None)
    assert gemm_cpu.gemm(torch.empty(0, K), packed, None, N).shape == (0, N)
    # K = 0: the bias alone
    b = torch.randn(N, generator=g)
    y = gemm_cpu.gemm(torch.empty(4, 0), gemm_cpu.pack_weight(torch.empty(N, 0)), b, N)
    assert torch.equal(y, b.expand(4, N))


def _fma_f32(a, b, c):
    """fp32 a * b + c rounded once (what an FMA gives), elementwise: the product is exact in
    float64, the sum is rounded to odd in float64 (TwoSum's error moves an even result one ulp
    towards the exact sum), and rounding that to fp32 is then correct (53 >= 24 + 2 bits)."""
    p, cd = a.double() * b.double(), c.double()
    s = p + cd
    bv = s - p
    err = (p - (s - bv)) + (cd - bv)
    fix = (err != 0) & ((s.view(torch.int64) & 1) == 0)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    return torch.where(fix, torch.nextafter(s, toward), s).float()


def _chain_reference(x, w, b, fused):
    """Each output column summed as the kernel does: from the bias (or 0), k ascending, in fp32,
    one FMA per term (fused) or a rounded product then a rounded sum."""
    acc = (b if b is not None else torch.zeros(w.shape[0])).expand(x.shape[0], w.shape[0]).clone()
    for k in range(x.shape[1]):
        xk, wk = x[:, k:k + 1].expand_as(acc), w[:, k].expand_as(acc)
        acc = _fma_f32(xk, wk, acc) if fused else acc + xk * wk
    return acc


def test_fma_f32_reference_rounds_once():
    one = torch.ones(1)
    # a * b = 2^-24 + 2^-60 exactly: 1 + a * b lies just above the fp32 tie 1 + 2^-24, so one
    # rounding goes up; a float64 sum then fp32 would round twice (to 1 + 2^-24, then to even 1)
    a, b = torch.tensor([1.0 + 2.0 ** -12]), torch.tensor([2.0 ** -24 * (1.0 - 2.0 ** -12 + 2.0 ** -24)])
    assert b.double().item() == 2.0 ** -24 * (1.0 - 2.0 ** -12 + 2.0 ** -24)  # exact in fp32
    assert (a.double() * b.double() + one.double()).float() == 1.0
    assert _fma_f32(a, b, one) == 1.0 + 2.0 ** -23
    tie = torch.tensor([2.0 ** -24])
    assert _fma_f32(tie, one, one) == 1.0  # an exact tie: to even
    # x * x = 1 + 2^-11 + 2^-24 exactly: the rounded product loses the 2^-24, the FMA keeps it
    x = torch.tensor([1.0 + 2.0 ** -12])
    c = torch.tensor([-(1.0 + 2.0 ** -11)])
    assert x * x + c == 0.0
    assert _fma_f32(x, x, c) == 2.0 ** -24


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_bit_identical_to_ordered_fp32_sums(isa, bias):
    """Rows 1-7 (every small tile: 1 x 64, 2 x 32, 3 x 32, 4-6 x 16, 7 = 4 + 3), panel tails,
    K blocks, 1 and 2 threads: each output is bit for bit the fp32 chain from the bias over k
    ascending (FMA in the AVX2 kernel; the generic C one may or may not contract), so a change in
    the kernels' loop order that changes the summation shows here."""
    g = torch.Generator().manual_seed(11)
    fused_only = gemm_cpu.kernel_isa() in (1, 2)
    for M in range(1, 8):
        for N, K in [(1, 33), (37, 1), (75, 130), (64, 7)]:
            x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
            b = torch.randn(N, generator=g) if bias else None
            packed = gemm_cpu.pack_weight(w)
            refs = [_chain_reference(x, w, b, True)] + ([] if fused_only else [_chain_reference(x, w, b, False)])
            for threads, kc in [(1, 0), (2, 0), (1, 5)]:
                y = gemm_cpu.gemm(x, packed, b, N, threads=threads, kc=kc)
                assert any(torch.equal(y.view(torch.int32), r.view(torch.int32)) for r in refs), (M, N, K, threads, kc)


def test_torch_fallback(monkeypatch):
    """Without the compiled kernels, or for another dtype, the same product from the packed weight."""
    g = torch.Generator().manual_seed(4)
    N, K = 35, 19
    x, w, b = torch.randn(6, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    packed = gemm_cpu.pack_weight(w)
    assert torch.equal(gemm_cpu.unpack_weight(packed, N), w)
    monkeypatch.setenv("QWORKER_CPU_KERNELS", "0")
    assert gemm_cpu.kernel_isa() is None
    _check(gemm_cpu.gemm(x, packed, b, N), x, w, b)
    monkeypatch.delenv("QWORKER_CPU_KERNELS")
    y64 = gemm_cpu.gemm(x.double(), packed.double(), b.double(), N)  # not fp32: torch, in float64
    assert y64.dtype == torch.float64
    _check(y64.float(), x, w, b)


def test_bad_shapes_raise():
    packed = gemm_cpu.pack_weight(torch.randn(20, 8))
    with pytest.raises(ValueError, match="last dimension"):
        gemm_cpu.gemm(torch.randn(3, 9), packed, None, 20)
    with pytest.raises(ValueError, match="n_out"):
        gemm_cpu.gemm(torch.randn(3, 8), packed, None, 33)
    with pytest.raises(ValueError, match="bias"):
        gemm_cpu.gemm(torch.randn(3, 8), packed, torch.randn(19), 20)
    with pytest.raises(ValueError, match="packed weight"):
        gemm_cpu.gemm(torch.randn(3, 8), torch.randn(20, 8), None, 20)
    with pytest.raises(ValueError, match="out"):
        gemm_cpu.gemm(torch.randn(3, 8), packed, None, 20, out=torch.empty(3, 21))
    with pytest.raises(ValueError, match="2-D"):
        gemm_cpu.pack_weight(torch.randn(4))


@pytest.mark.parametrize("flags", [["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"], ["-mno-avx512f"], ["-mno-avx"]],
                         ids=["avx512", "avx2", "generic"])
def test_every_isa_path_compiles(tmp_path, flags):
    """The AVX-512 build only runs on AVX-512 CPUs: compile it (and the others) here regardless,
    warnings as errors, and check which path the preprocessor picked."""
    cc = os.environ.get("CC", "cc")
    probe = subprocess.run([cc, *flags, "-x", "c", "-c", "-o", os.devnull, "-"], input=b"int x;", capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"{cc} does not take {' '.join(flags)}")
    opt_in = ["-DQW_GEMM_AVX512"] if "-mavx512f" in flags else []  # compile the opt-in AVX-512 kernel too
    cmd = [cc, "-O2", "-march=x86-64-v2", "-mavx2", "-mfma", "-mf16c", *flags, *opt_in, "-fopenmp", "-fPIC", "-std=gnu11",
           "-Wall", "-Wextra", "-Werror", "-S", "-o", str(tmp_path / "gemm.s"), str(SOURCE)]
    if flags == ["-mno-avx"]:
        cmd = [c for c in cmd if c not in ("-mavx2", "-mfma", "-mf16c")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    asm = (tmp_path / "gemm.s").read_text()
    if "-mavx512f" in flags:
        assert "zmm" in asm and "vfmadd" in asm
    elif flags == ["-mno-avx512f"]:
        assert "ymm" in asm and "vfmadd" in asm and "zmm" not in asm
    else:
        assert "ymm" not in asm and "zmm" not in asm


def test_bench_runs_small():
    """bench/small_gemm.py end to end on one layer, two row counts, one round (a smoke test: no timings checked)."""
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "bench.small_gemm", "--layers", "1", "--no-lm-head", "--rows", "1,7",
                        "--rounds", "1"], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["1", "7"]
    assert all(float(row[-1]) < 1e-4 for row in rows)  # max rel difference from oneDNN
