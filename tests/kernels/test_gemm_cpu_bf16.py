"""The packed GEMM with bf16 weights (kernels/gemm_cpu.py, csrc/gemm_bf16.c): y = x @ W^T (+ bias)
with W packed in bf16, x fp32 or bf16, fp32 accumulation, fp32 or bf16 (round to nearest even)
output. Against a float64 reference of the same operands and against the fp32 panels kernel on
the widened weights (same tiles, same summation order: equal bit for bit, except the AVX512_BF16
dot-product kernel's pairwise sums for bf16 x), under each ISA build
this CPU runs; every tile height and panel tail, odd K and K = 1, leading dims, strided x and out,
the blocking knobs (K blocks with bf16 output), NaN/Inf, the rounding itself (ties, overflow,
NaN, -0, denormals), fewer OpenMP threads than asked, the torch fallback, bad inputs, each ISA
path compiled with warnings as errors, and a memory-checked (ASan + UBSan) run of the C kernel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import isa  # noqa: F401  (fixture)

from kernels import cpu as kcpu
from kernels import gemm_cpu

CC = os.environ.get("CC", "cc")
pytestmark = pytest.mark.skipif(shutil.which(CC) is None, reason="no C compiler on this machine")
ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(kcpu.__file__).with_name("csrc") / "gemm_bf16.c"
BF, F32 = torch.bfloat16, torch.float32
ROWS = (1, 2, 3, 5, 6, 7, 13, 70, 130)
NK = [(37, 33), (16, 1), (1, 7), (50, 64), (129, 19), (33, 200), (13, 300)]  # N off the panel, odd K, K = 1; one panel: threads split rows


def _cpu_flags() -> set[str]:
    return set(kcpu._cpu_features().split())


def _dot_kernel(isa: str) -> bool:
    """Whether ``isa``'s build runs the AVX512_BF16 dot-product kernel for bf16 x (pairwise sums:
    not the FMA kernel's order, so not bit for bit the fp32 kernel's)."""
    return isa == "avx512" and "avx512_bf16" in _cpu_flags()


def _ref64(x, w, b):
    """float64 product of the operands' exact values (x as given: fp32 x is not rounded)."""
    y = x.double() @ w.double().T
    return y + b.double() if b is not None else y


def _check_f32(y, ref, K):
    assert y.dtype == F32 and y.shape == ref.shape
    # products of bf16 x bf16 are exact in fp32; only the K additions round
    tol = 2e-6 * (K ** 0.5 + 1) * max(1.0, ref.abs().max().item())
    err = (y.double() - ref).abs().max().item() if y.numel() else 0.0
    assert err <= tol, f"max abs error {err} > {tol}"


def _check_bf16(yb, ref, K=None):
    """Equal to the float64 reference rounded to bf16, except (rare) a value 1 bf16 ulp off where
    the fp32 sum and the exact one fall on different sides of a rounding boundary, or, for a
    result near zero after cancellation, off by no more than the fp32 sum's own error."""
    assert yb.dtype == BF and yb.shape == ref.shape
    rb = ref.to(BF)
    diff = yb != rb
    if diff.any():
        K = ref.shape[-1] if K is None else K
        fp32_err = 2e-6 * (K ** 0.5 + 1) * max(1.0, ref.abs().max().item())
        ulp = (rb.float().abs() * 2.0 ** -7).clamp_min(fp32_err)
        assert ((yb.float() - rb.float()).abs()[diff] <= ulp[diff] * 1.01).all(), "more than 1 bf16 ulp off"
        assert diff.float().mean().item() < 0.01, f"{int(diff.sum())} of {diff.numel()} values off by 1 ulp"


def _data(g, M, N, K, bias_dtype=F32):
    w = torch.randn(N, K, generator=g).to(BF)
    x = torch.randn(M, K, generator=g).to(BF)
    b = None if bias_dtype is None else torch.randn(N, generator=g).to(bias_dtype)
    return x, w, b


def test_pack_layout_and_unpack():
    g = torch.Generator().manual_seed(0)
    for N, K in [(37, 5), (16, 3), (1, 1), (40, 0)]:
        w = torch.randn(N, K, generator=g).to(BF)
        p = gemm_cpu.pack_weight(w, "panels")
        P = -(-N // 16)
        assert p.dtype == BF and p.shape == (P, K, 16) and p.is_contiguous()
        for n in range(P * 16):
            for k in range(K):
                expect = w[n, k] if n < N else torch.zeros((), dtype=BF)
                assert torch.equal(p[n // 16, k, n % 16], expect)
        back = gemm_cpu.unpack_weight(p, N)
        assert back.dtype == BF and torch.equal(back, w)
    # fp32 (and other dtypes) pack to fp32 as before
    assert gemm_cpu.pack_weight(torch.randn(20, 3), "panels").dtype == F32
    assert gemm_cpu.pack_weight(torch.randn(20, 3).half(), "panels").dtype == F32


@pytest.mark.parametrize("bias", [None, F32, BF], ids=["nobias", "bias32", "bias16"])
def test_every_tile_shape_under_each_isa(isa, bias):
    g = torch.Generator().manual_seed(1)
    dot = _dot_kernel(isa)
    assert gemm_cpu.kernel_isa(BF) == {"avx512": 2 if dot else 1, "avx2": 1, "generic": 0}[isa]
    for N, K in NK:
        for M in ROWS:
            x, w, b = _data(g, M, N, K, bias)
            packed = gemm_cpu.pack_weight(w, "panels")
            packed32 = gemm_cpu.pack_weight(w.float(), "panels")
            ref = _ref64(x, w, b)
            for threads in (1, 2):
                y = gemm_cpu.gemm(x, packed, b, N, out_dtype=F32, threads=threads)
                _check_f32(y, ref, K)
                # fp32 x holding the same (bf16) values: the FMA kernel (the dot-product kernel
                # takes bf16 x only), which is the fp32 kernel on the widened operands: same
                # tiles, same order, same bits
                y32 = gemm_cpu.gemm(x.float(), packed, b, N, out_dtype=F32, threads=threads)
                _check_f32(y32, ref, K)
                assert torch.equal(y32, gemm_cpu.gemm(x.float(), packed32, None if b is None else b.float(), N,
                                                      threads=threads)), (M, N, K)
                assert dot or torch.equal(y, y32), (M, N, K)
                yb = gemm_cpu.gemm(x, packed, b, N, threads=threads)  # default: bf16 out
                _check_bf16(yb, ref, K)
                assert torch.equal(yb, y.to(BF)), "bf16 output is not the fp32 accumulator rounded"


def test_fp32_x_used_as_is(isa):
    """fp32 x that is not bf16-representable is not rounded: the result is the product of x's
    fp32 values with the bf16 weights (the fp32 kernel on the widened weights, bit for bit)."""
    g = torch.Generator().manual_seed(2)
    N, K = 70, 45
    w = torch.randn(N, K, generator=g).to(BF)
    packed, packed32 = gemm_cpu.pack_weight(w, "panels"), gemm_cpu.pack_weight(w.float(), "panels")
    for M in (1, 6, 13):
        x = torch.randn(M, K, generator=g)
        assert not torch.equal(x, x.to(BF).float())
        y = gemm_cpu.gemm(x, packed, None, N, out_dtype=F32)
        _check_f32(y, _ref64(x, w, None), K)
        assert torch.equal(y, gemm_cpu.gemm(x, packed32, None, N))
        assert not torch.equal(y, gemm_cpu.gemm(x.to(BF), packed, None, N, out_dtype=F32))


def test_leading_dims_strided_x_and_out(isa):
    g = torch.Generator().manual_seed(3)
    N, K = 45, 40
    w, b = torch.randn(N, K, generator=g).to(BF), torch.randn(N, generator=g)
    packed = gemm_cpu.pack_weight(w, "panels")
    for xdt in (BF, F32):
        x3 = torch.randn(3, 5, K, generator=g).to(BF).to(xdt)
        for odt in (BF, F32):
            y3 = gemm_cpu.gemm(x3, packed, b, N, out_dtype=odt)
            assert y3.shape == (3, 5, N) and y3.dtype == odt
            assert torch.equal(y3.reshape(15, N), gemm_cpu.gemm(x3.reshape(15, K), packed, b, N, out_dtype=odt))
        x1 = x3[0, 0]  # 1-D x
        assert torch.equal(gemm_cpu.gemm(x1, packed, b, N), gemm_cpu.gemm(x1[None], packed, b, N)[0])
        for M in (1, 2, 7, 13, 64):
            wide = torch.randn(M, K + 11, generator=g).to(BF).to(xdt)
            x = wide[:, 3:3 + K]  # row stride K + 11: passed uncopied
            before = wide.clone()
            ref = _ref64(x, w, b)
            for odt in (BF, F32):
                fill = float("nan")
                buf = torch.full((M, 3 * N), fill, dtype=odt)
                out = buf[:, N:2 * N]
                for threads in (1, 2, 3):
                    assert gemm_cpu.gemm(x, packed, b, N, out=out, out_dtype=odt, threads=threads) is out
                    (_check_f32 if odt == F32 else _check_bf16)(out, ref, K)
                    assert torch.equal(out, gemm_cpu.gemm(x.contiguous(), packed, b, N, out_dtype=odt))
                assert torch.isnan(buf[:, :N]).all() and torch.isnan(buf[:, 2 * N:]).all(), "written outside out"
            assert torch.equal(wide, before)
        # transposed (column stride != 1: copied once), expanded rows
        for x in (torch.randn(K, 9, generator=g).to(BF).to(xdt).T, torch.randn(K, generator=g).to(BF).to(xdt).expand(4, K)):
            _check_bf16(gemm_cpu.gemm(x, packed, b, N), _ref64(x, w, b), K)


def test_blocking_knobs_and_k_blocks(isa):
    """Small x blocks, weight groups and K blocks; several K blocks with a bf16 output go through
    the fp32 scratch (one rounding at the end), so the bf16 result is still the fp32 one rounded."""
    g = torch.Generator().manual_seed(4)
    M, N, K = 77, 150, 45
    x, w, b = _data(g, M, N, K, BF)
    packed = gemm_cpu.pack_weight(w, "panels")
    ref = _ref64(x, w, b)
    for mc, group, kc in [(1, 1, 0), (7, 2, 5), (13, 3, 1), (0, 0, 0), (0, 0, 44), (100, 9, 1000), (0, 0, 7)]:
        for threads in (1, 2):
            y = gemm_cpu.gemm(x, packed, b, N, out_dtype=F32, mc=mc, group=group, kc=kc, threads=threads)
            _check_f32(y, ref, K)
            yb = gemm_cpu.gemm(x, packed, b, N, mc=mc, group=group, kc=kc, threads=threads)
            assert torch.equal(yb, y.to(BF)), (mc, group, kc)
            _check_bf16(yb, ref, K)
    # the default K block (2048): K = 4100 is three blocks
    x, w, b = _data(g, 3, 40, 4100, F32)
    y = gemm_cpu.gemm(x, gemm_cpu.pack_weight(w, "panels"), b, 40)
    _check_bf16(y, _ref64(x, w, b), 4100)


def test_bf16_rounding_is_torchs(isa):
    """K = 0: y is the bias alone, rounded once to bf16: bit for bit torch's float -> bfloat16
    (round to nearest even at ties, overflow to Inf, NaN, -0, denormals), in full and partial
    panels and every tile height."""
    one = 1.0
    vals = [one + 2 ** -8, one + 3 * 2 ** -8, -(one + 2 ** -8), one + 2 ** -8 + 2 ** -20, 3.3895314e38, 3.4e38, -3.4e38,
            float("inf"), float("-inf"), float("nan"), -float("nan"), -0.0, 0.0, 1e-40, -1e-40, 2 ** -133, 1.00390625,
            65535.0, 0.1, -7.75]
    g = torch.Generator().manual_seed(5)
    bias = torch.tensor(vals + torch.randn(40 - len(vals), generator=g).tolist(), dtype=F32)
    bias[-5:] = bias[-5:].to(BF).float() + bias[-5:].to(BF).float() * 2 ** -8  # exact ties
    N = bias.numel()
    packed = gemm_cpu.pack_weight(torch.empty(N, 0, dtype=BF), "panels")
    # NaN: the kernel writes 0x7fc0 (torch's scalar conversion); torch's vectorised one writes 0xffff
    nan = torch.isnan(bias)
    expect = bias.to(BF).view(torch.int16).clone()
    expect[nan] = 0x7FC0
    for M in (1, 2, 3, 6, 7, 13):
        y = gemm_cpu.gemm(torch.empty(M, 0, dtype=BF), packed, bias, N)
        assert torch.equal(y.view(torch.int16), expect.expand(M, N)), (M, y[0].view(torch.int16), expect)
        y = gemm_cpu.gemm(torch.empty(M, 0), packed[:2].contiguous(), bias[:17], 17)  # partial last panel
        assert torch.equal(y.view(torch.int16), expect[:17].expand(M, 17))
    # through the FMA path too: x = 1 against one weight of 1 plus a tie-making bias
    w = torch.ones(N, 1, dtype=BF)
    y = gemm_cpu.gemm(torch.ones(3, 1, dtype=BF), gemm_cpu.pack_weight(w, "panels"), bias - 1.0, N)
    ref32 = gemm_cpu.gemm(torch.ones(3, 1, dtype=BF), gemm_cpu.pack_weight(w, "panels"), bias - 1.0, N, out_dtype=F32)
    assert torch.equal(torch.isnan(y), torch.isnan(ref32))
    assert torch.equal(y[~torch.isnan(y)].view(torch.int16), ref32[~torch.isnan(ref32)].to(BF).view(torch.int16))


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_nan_inf_propagation(isa, bias):
    """NaN in x: NaN exactly in that row; Inf: +-Inf or NaN (Inf - Inf, Inf * 0 on a zero weight)
    exactly where the float64 reference has them; the last panel's padding lanes (Inf * 0 = NaN
    there) reach neither real columns nor memory past N."""
    g = torch.Generator().manual_seed(6)
    for M, N, K in [(1, 37, 33), (5, 37, 33), (13, 50, 20), (7, 1, 5), (3, 17, 1), (20, 129, 64)]:
        w = torch.randn(N, K, generator=g).to(BF)
        w[::3, :] = 0.0
        b = torch.randn(N, generator=g) if bias else None
        packed = gemm_cpu.pack_weight(w, "panels")
        x = torch.randn(M, K, generator=g).to(BF)
        x[0, K // 2] = float("inf")
        if M > 1:
            x[1, 0] = float("nan")
        if M > 2:
            x[2, 0] = float("inf")
            x[2, K - 1] = float("-inf") if K > 1 else x[2, 0]
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        for odt in (F32, BF):
            for threads in (1, 2):
                buf = torch.full((M, N + 16), 7.0, dtype=odt)
                out = buf[:, :N]
                gemm_cpu.gemm(x, packed, b, N, out=out, out_dtype=odt, threads=threads)
                assert torch.equal(torch.isnan(out), torch.isnan(ref)), (M, N, K, odt)
                inf = torch.isinf(ref)
                assert torch.equal(out[inf].double(), ref[inf]), "infinities differ"
                fin = torch.isfinite(ref)
                torch.testing.assert_close(out[fin].double(), ref[fin], rtol=1e-2 if odt == BF else 1e-5, atol=1e-5)
                assert torch.equal(buf[:, N:], torch.full((M, 16), 7.0, dtype=odt)), "written past N"


_TEAM_SCRIPT = r"""
import torch
from kernels import gemm_cpu
assert gemm_cpu.kernel_isa(torch.bfloat16) is not None
g = torch.Generator().manual_seed(0)
bad = []
for M, N, K, threads in [(40, 100, 64, 2), (40, 100, 64, 4), (3, 40, 300, 4), (100, 17, 40, 8), (1, 200, 50, 3)]:
    x, w, b = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16(), torch.randn(N, generator=g)
    ref = x.float() @ w.float().T + b
    for odt in (torch.float32, torch.bfloat16):
        out = torch.full((M, N), float("nan"), dtype=odt)
        gemm_cpu.gemm(x, gemm_cpu.pack_weight(w, "panels"), b, N, out=out, out_dtype=odt, threads=threads)
        if not torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-3):
            bad.append((M, N, K, threads, str(odt), int(torch.isnan(out).sum())))
print("BAD", bad)
"""


@pytest.mark.parametrize("limit", ["1", "2"])
def test_openmp_team_smaller_than_requested(limit):
    """OMP_THREAD_LIMIT below the threads asked for: every share still computed (no NaN left)."""
    env = dict(os.environ, OMP_THREAD_LIMIT=limit)
    r = subprocess.run([sys.executable, "-c", _TEAM_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "BAD []" in r.stdout, r.stdout


def test_torch_fallback_and_other_dtypes(monkeypatch):
    """Without the compiled kernels, or for an x dtype the kernel does not take, the same product
    in torch (x's values, fp32 arithmetic, one rounding); out= works there too."""
    g = torch.Generator().manual_seed(7)
    M, N, K = 6, 35, 19
    x, w, b = _data(g, M, N, K, BF)
    x[2, 3] = float("nan")
    packed = gemm_cpu.pack_weight(w, "panels")
    kern = {odt: gemm_cpu.gemm(x, packed, b, N, out_dtype=odt) for odt in (F32, BF)}
    y16 = gemm_cpu.gemm(x.half(), packed, b, N)  # fp16 x: torch
    assert y16.dtype == BF
    torch.testing.assert_close(y16.float(), kern[BF].float(), rtol=1e-2, atol=1e-2, equal_nan=True)
    monkeypatch.setenv("QWORKER_CPU_KERNELS", "0")
    assert gemm_cpu.kernel_isa(BF) is None
    for odt in (F32, BF):
        y = gemm_cpu.gemm(x, packed, b, N, out_dtype=odt)
        assert y.dtype == odt
        torch.testing.assert_close(y.float(), kern[odt].float(), rtol=1e-5 if odt == F32 else 1e-2, atol=1e-5, equal_nan=True)
        out = torch.empty(M, N, dtype=odt)
        assert gemm_cpu.gemm(x, packed, b, N, out=out, out_dtype=odt) is out
        assert torch.equal(out, y) or torch.allclose(out.float(), y.float(), equal_nan=True)
        assert gemm_cpu.gemm(x.reshape(2, 3, K), packed, b, N).shape == (2, 3, N)


def test_bad_inputs_raise():
    packed = gemm_cpu.pack_weight(torch.randn(20, 8).to(BF), "panels")
    x = torch.randn(3, 8).to(BF)
    with pytest.raises(ValueError, match="out_dtype"):
        gemm_cpu.gemm(x, packed, None, 20, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="out_dtype"):  # fp32 weights give fp32 only
        gemm_cpu.gemm(x.float(), gemm_cpu.pack_weight(torch.randn(20, 8), "panels"), None, 20, out_dtype=BF)
    with pytest.raises(ValueError, match="out"):
        gemm_cpu.gemm(x, packed, None, 20, out=torch.empty(3, 20))  # fp32 out for a bf16 result
    with pytest.raises(ValueError, match="out"):
        gemm_cpu.gemm(x, packed, None, 20, out=torch.empty(3, 21, dtype=BF))
    with pytest.raises(ValueError, match="last dimension"):
        gemm_cpu.gemm(torch.randn(3, 9).to(BF), packed, None, 20)
    with pytest.raises(ValueError, match="n_out"):
        gemm_cpu.gemm(x, packed, None, 33)
    with pytest.raises(ValueError, match="bias"):
        gemm_cpu.gemm(x, packed, torch.randn(19), 20)
    # empty inputs
    assert gemm_cpu.gemm(torch.empty(0, 8, dtype=BF), packed, None, 20).shape == (0, 20)
    b = torch.randn(20)
    y = gemm_cpu.gemm(torch.empty(2, 3, 0, dtype=BF), gemm_cpu.pack_weight(torch.empty(20, 0, dtype=BF), "panels"), b, 20,
                      out_dtype=F32)
    assert torch.equal(y, b.expand(2, 3, 20))


_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]


@pytest.mark.parametrize("flags", [_AVX512, [*_AVX512, "-mavx512bf16", "-DQW_GEMM_AVX512"], ["-mno-avx512f"], ["-mno-avx"]],
                         ids=["avx512", "avx512-bf16", "avx2", "generic"])
def test_every_isa_path_compiles(tmp_path, flags):
    """Each build's flags, warnings as errors; the AVX2 kernel (FMA on ymm) in the avx512 and avx2
    builds, no AVX at all in the generic one; the dot-product kernel (VDPBF16PS on zmm) only in an
    avx512 build for a CPU with AVX512_BF16."""
    probe = subprocess.run([CC, *flags, "-x", "c", "-c", "-o", os.devnull, "-"], input=b"int x;", capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"{CC} does not take {' '.join(flags)}")
    cmd = [CC, "-O2", "-march=x86-64-v2", "-mavx2", "-mfma", "-mf16c", *flags, "-fopenmp", "-fPIC", "-std=gnu11",
           "-Wall", "-Wextra", "-Werror", "-S", "-o", str(tmp_path / "g.s"), str(SOURCE)]
    if flags == ["-mno-avx"]:
        cmd = [c for c in cmd if c not in ("-mavx2", "-mfma", "-mf16c")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    asm = (tmp_path / "g.s").read_text()
    if flags == ["-mno-avx"]:
        assert "ymm" not in asm and "zmm" not in asm and "vfmadd" not in asm
    else:
        assert "ymm" in asm and "vfmadd231ps" in asm
    assert ("vdpbf16ps" in asm) == ("-mavx512bf16" in flags)


# ---- memory-checked run of the C kernel (AddressSanitizer + UBSan) ----

_DRIVER = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int qw_gemm_bf16(const void *x, int64_t ldx, int x_bf16, const uint16_t *wp, const void *bias, int bias_bf16, void *y,
                 int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads, int64_t mc, int64_t group,
                 int64_t kc);
int qw_gemm_bf16_isa(void);
static uint64_t rs = 88172645463325252ull;
static uint64_t rnd(void) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return rs; }
static uint16_t tobf(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); } /* truncation: any bf16 */
static float tof(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static uint16_t brand(void) { return tobf((float)((rnd() >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f); }
#define SENT 0x5a5a
static long fails = 0;
/* xb/bb/yb: x, bias, y in bf16 (else fp32); special: 1 NaN in x, 2 +-Inf in x, 3 zero weight rows + Inf */
static void run(int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldy, int th, int64_t mc, int64_t group,
                int64_t kc, int usebias, int xb, int bb, int yb, int special) {
    const int64_t P = (N + 15) / 16;
    const size_t nx = M > 0 && K > 0 ? (size_t)((M - 1) * ldx + K) : 0;
    float *xv = malloc(nx * sizeof(float) + 1); /* the values, bf16-representable */
    for (size_t i = 0; i < nx; i++) xv[i] = tof(brand());
    if (special && M > 0 && K > 0) xv[(rnd() % M) * ldx + rnd() % K] = special == 1 ? NAN : INFINITY;
    if (special == 2 && M > 0 && K > 0) xv[(rnd() % M) * ldx + rnd() % K] = -INFINITY;
    void *x = malloc(nx * (xb ? 2 : 4) + 1);
    for (size_t i = 0; i < nx; i++) { if (xb) ((uint16_t *)x)[i] = tobf(xv[i]); else ((float *)x)[i] = xv[i]; }
    uint16_t *w = malloc((size_t)(N * K) * 2 + 1);
    for (int64_t i = 0; i < N * K; i++) w[i] = brand();
    if (special == 3) for (int64_t n = 0; n < N; n += 3) for (int64_t k = 0; k < K; k++) w[n * K + k] = 0;
    uint16_t *wp = malloc((size_t)(P * K * 16) * 2 + 1);
    for (int64_t p = 0; p < P; p++) for (int64_t k = 0; k < K; k++) for (int c = 0; c < 16; c++)
        wp[(p * K + k) * 16 + c] = p * 16 + c < N ? w[(p * 16 + c) * K + k] : 0;
    float *bv = malloc((size_t)N * sizeof(float) + 1);
    for (int64_t n = 0; n < N; n++) bv[n] = tof(brand());
    void *b = NULL;
    if (usebias) {
        b = malloc((size_t)N * (bb ? 2 : 4) + 1);
        for (int64_t n = 0; n < N; n++) { if (bb) ((uint16_t *)b)[n] = tobf(bv[n]); else ((float *)b)[n] = bv[n]; }
    }
    const int es = yb ? 2 : 4;
    const size_t ny = M > 0 ? (size_t)((M - 1) * ldy + N) : 0;
    unsigned char *y = malloc(ny * es + 1);
    memset(y, SENT & 0xff, ny * es);
    int bad = qw_gemm_bf16(x, ldx, xb, wp, b, bb, y, ldy, yb, M, N, K, th, mc, group, kc) != 0;
    for (int64_t i = 0; i < M && !bad; i++) {
        for (int64_t n = 0; n < N && !bad; n++) {
            double r = usebias ? bv[n] : 0.0, mag = fabs(r);
            for (int64_t k = 0; k < K; k++) { double t = (double)xv[i * ldx + k] * tof(w[n * K + k]); r += t; mag += fabs(t); }
            float v = yb ? tof(((uint16_t *)y)[i * ldy + n]) : ((float *)y)[i * ldy + n];
            double tol = yb ? fabs(r) * (1.0 / 128) + 1e-5 * mag + 1e-6 : 1e-5 * mag + 1e-6;
            bad = isnan(r) ? !isnan(v) : isinf(r) ? v != r : (isnan(v) || fabs(v - r) > tol);
        }
        for (int64_t c = (int64_t)N * es; c < ldy * es && i < M - 1 && !bad; c++) bad = y[i * ldy * es + c] != (SENT & 0xff);
    }
    if (bad && fails++ < 10)
        fprintf(stderr, "FAIL M=%ld N=%ld K=%ld ldx=%ld ldy=%ld th=%d mc=%ld group=%ld kc=%ld bias=%d xb=%d bb=%d yb=%d special=%d\n",
                (long)M, (long)N, (long)K, (long)ldx, (long)ldy, th, (long)mc, (long)group, (long)kc, usebias, xb, bb, yb,
                special);
    free(xv); free(x); free(w); free(wp); free(bv); free(b); free(y);
}
/* each row's bits are the same alone (M = 1, one thread, default knobs) as in a batch of M on th
 * threads with the knobs (K blocks starting at odd k included): bf16 or fp32 x, fp32 bias and y */
static void run_rows(int64_t M, int64_t N, int64_t K, int th, int64_t mc, int64_t group, int64_t kc, int xb) {
    const int64_t P = (N + 15) / 16;
    void *x = malloc((size_t)(M * K) * 4 + 1);
    for (int64_t i = 0; i < M * K; i++) { if (xb) ((uint16_t *)x)[i] = brand(); else ((float *)x)[i] = tof(brand()); }
    uint16_t *wp = malloc((size_t)(P * K * 16) * 2 + 1);
    for (int64_t i = 0; i < P * K * 16; i++) wp[i] = (i % 16) + (i / (K * 16)) * 16 < N ? brand() : 0;
    float *b = malloc((size_t)N * 4 + 1), *y = malloc((size_t)(M * N) * 4 + 1), *y1 = malloc((size_t)N * 4 + 1);
    for (int64_t n = 0; n < N; n++) b[n] = tof(brand());
    int bad = qw_gemm_bf16(x, K, xb, wp, b, 0, y, N, 0, M, N, K, th, mc, group, kc) != 0;
    for (int64_t i = 0; i < M && !bad; i++)
        bad = qw_gemm_bf16((char *)x + i * K * (xb ? 2 : 4), K, xb, wp, b, 0, y1, N, 0, 1, N, K, 1, 0, 0, 0) != 0 ||
              memcmp(y1, y + i * N, (size_t)N * 4) != 0;
    if (bad && fails++ < 10)
        fprintf(stderr, "FAIL rows M=%ld N=%ld K=%ld th=%d mc=%ld group=%ld kc=%ld xb=%d: a row's bits depend on the batch\n",
                (long)M, (long)N, (long)K, th, (long)mc, (long)group, (long)kc, xb);
    free(x); free(wp); free(b); free(y); free(y1);
}
#define PICK(a) a[rnd() % (sizeof a / sizeof a[0])]
int main(int argc, char **argv) {
    long iters = argc > 1 ? atol(argv[1]) : 300;
    printf("isa %d\n", qw_gemm_bf16_isa());
    static const int64_t Ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 17, 23, 25, 36, 37, 50, 70, 97};
    static const int64_t Ns[] = {1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 100, 129};
    static const int64_t Ks[] = {0, 1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 64, 65};
    static const int64_t knobs[][3] = {{0, 0, 0}, {0, 0, 0}, {1, 1, 1}, {7, 2, 5}, {13, 3, 2}, {0, 1, 3}, {5, 0, 0}};
    for (long it = 0; it < iters; it++) {
        int64_t M = PICK(Ms), N = PICK(Ns), K = PICK(Ks);
        int64_t ldx = K + (rnd() % 3 == 0 ? rnd() % 5 + 1 : 0), ldy = N + (rnd() % 3 == 0 ? rnd() % 5 + 1 : 0);
        const int64_t *kn = knobs[rnd() % 7];
        run(M, N, K, ldx, ldy, 1 + (int)(rnd() % 3), kn[0], kn[1], kn[2], (int)(rnd() & 1), (int)(rnd() & 1),
            (int)(rnd() & 1), (int)(rnd() & 1), (int)(rnd() % 4));
    }
    run(1, 4096 + 7, 16, 16, 4096 + 7, 2, 0, 0, 0, 1, 1, 1, 1, 0);
    run(1, 40, 4100, 4100, 40, 2, 0, 0, 0, 1, 1, 0, 1, 2);   /* three K blocks, bf16 y via the fp32 scratch */
    run(3, 33, 2049, 2051, 40, 3, 0, 0, 0, 1, 0, 1, 0, 1);
    run(1500, 17, 3, 3, 17, 2, 0, 0, 0, 1, 1, 1, 1, 2);
    run(100, 17, 40, 41, 19, 16, 0, 0, 0, 1, 1, 0, 1, 0);   /* more threads than panels: rows split */
    run(7, 40, 64, 64, 40, 8, 0, 0, 0, 1, 0, 0, 1, 3);      /* uneven row ranges per thread */
    static const int64_t rknobs[][4] = {{1, 0, 0, 1}, {2, 0, 0, 3}, {3, 7, 1, 5}, {2, 13, 3, 0}, {3, 0, 2, 2}};
    for (int r = 0; r < 5; r++)
        for (int xb = 0; xb < 2; xb++) {
            const int64_t *kn = rknobs[r];
            run_rows(13, 70, 33, (int)kn[0], kn[1], kn[2], kn[3], xb);
            run_rows(5, 33, 64, (int)kn[0], kn[1], kn[2], kn[3], xb);
        }
    printf("fails %ld\n", fails);
    return fails != 0;
}
"""


# The dot-product kernel's primitives (AVX512_BF16) in plain C, with the instruction's order (the
# odd pair's product first) and its bf16 denormals-as-zero: its tiling, pairing and odd-K tail run,
# memory-checked, on a CPU without AVX512_BF16.
_DOT_GUARD = "#if QW_BF_ISA == 1 && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(QW_GEMM_AVX512)\n"
_DOT_BEGIN = "/* dot-product primitives (the test suite swaps this block for plain C to run the tiling anywhere) */\n"
_DOT_END = "/* end of the dot-product primitives */\n"
_EMU_DOT = r"""
typedef struct { float v[16]; } dvec;
typedef struct { uint16_t h[32]; } dpair;
static inline dvec dvec_zero(void) { dvec r; memset(&r, 0, sizeof r); return r; }
static inline dvec dvec_load(const float *p) { dvec r; memcpy(r.v, p, sizeof r.v); return r; }
static inline void dvec_store(float *p, dvec v) { memcpy(p, v.v, sizeof v.v); }
static inline dpair w_pairs(const uint16_t *r0, const uint16_t *r1) {
    dpair r;
    for (int c = 0; c < 16; c++) r.h[2 * c] = r0[c], r.h[2 * c + 1] = r1 ? r1[c] : 0;
    return r;
}
static inline dpair x_pair(uint32_t bits) {
    dpair r;
    for (int c = 0; c < 16; c++) r.h[2 * c] = (uint16_t)bits, r.h[2 * c + 1] = (uint16_t)(bits >> 16);
    return r;
}
static inline float daz(uint16_t h) { return (h & 0x7f80) ? bf16_to_f32(h) : bf16_to_f32(h & 0x8000); }
static inline dvec dot2(dvec acc, dpair x, dpair w) {
    for (int c = 0; c < 16; c++) {
        acc.v[c] = fmaf(daz(x.h[2 * c + 1]), daz(w.h[2 * c + 1]), acc.v[c]);
        acc.v[c] = fmaf(daz(x.h[2 * c]), daz(w.h[2 * c]), acc.v[c]);
    }
    return acc;
}
"""


def _dot_emulated_source(tmp_path: Path) -> Path:
    text = SOURCE.read_text()
    assert text.count(_DOT_GUARD) == 1 and text.count(_DOT_BEGIN) == 1 and text.count(_DOT_END) == 1, \
        "gemm_bf16.c's dot-product block changed: update this test"
    head, rest = text.split(_DOT_BEGIN)
    _, tail = rest.split(_DOT_END)
    out = tmp_path / "gemm_bf16_dot_emulated.c"
    out.write_text((head + "#include <math.h>\n" + _EMU_DOT + tail).replace(_DOT_GUARD, "#if QW_BF_ISA == 1\n"))
    return out


@pytest.mark.parametrize("variant", ["avx2", "generic", "dot-emulated", "dot"])
def test_kernel_under_address_sanitizer(tmp_path, variant):
    """Exact-size heap buffers for x, the packed weight, bias and y (rows ldx/ldy apart, sentinels
    in the row gaps), every combination of fp32/bf16 x, bias and y: no out-of-bounds access, no
    undefined behaviour, values within fp32 (or bf16) rounding of a float64 reference, NaN/Inf
    where it has them, over odd M, N, K, strides, threads and blocking knobs. "dot": the real
    AVX512_BF16 kernel, where the CPU has it; "dot-emulated": its tiling on any AVX2 CPU."""
    if variant in ("avx2", "dot-emulated") and "avx2" not in kcpu.available_isas():
        pytest.skip("no AVX2 on this CPU")
    if variant == "dot" and not ("avx512" in kcpu.available_isas() and _dot_kernel("avx512")):
        pytest.skip("this CPU has no AVX512_BF16 (the dot-emulated build checks the kernel's tiling)")
    flags = {"avx2": ["-march=native", "-mno-avx512f"], "generic": ["-march=native", "-mno-avx"],
             "dot-emulated": ["-march=native", "-mno-avx512f"], "dot": ["-march=native", "-DQW_GEMM_AVX512"]}[variant]
    source = _dot_emulated_source(tmp_path) if variant == "dot-emulated" else SOURCE
    (tmp_path / "driver.c").write_text(_DRIVER)
    exe = tmp_path / "driver"
    # -O0 for the emulated build: gcc takes ~60 s to optimise its unrolled struct-vector tiles
    opt = "-O0" if variant == "dot-emulated" else "-O1"
    cmd = [CC, opt, "-g", *flags, "-fno-trapping-math", "-fopenmp", "-std=gnu11", "-fsanitize=address,undefined",
           "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-o", str(exe), str(source), str(tmp_path / "driver.c"), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "sanitize" in r.stderr:
        pytest.skip(f"{CC} cannot build with -fsanitize=address: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1")
    env.pop("LD_PRELOAD", None)
    r = subprocess.run([str(exe), "300"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "fails 0" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert f"isa {dict(avx2=1, generic=0).get(variant, 2)}" in r.stdout


def test_bench_bf16_runs_small():
    """bench/small_gemm.py --dtype bfloat16 end to end on one layer, two row counts, 1 and 2
    threads, one round (a smoke test: no timings checked; the bf16 output within bf16 rounding of
    the fp32 panels')."""
    r = subprocess.run([sys.executable, "-m", "bench.small_gemm", "--dtype", "bfloat16", "--layers", "1", "--no-lm-head",
                        "--rows", "1,7", "--threads", "1,2", "--rounds", "1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line and line.split()[0].isdigit()]
    assert [(row[0], row[1]) for row in rows] == [("1", "1"), ("7", "1"), ("1", "2"), ("7", "2")]
    assert all(float(row[-1]) < 1e-2 for row in rows)  # max rel difference from the fp32 panels
