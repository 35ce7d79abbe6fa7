"""Adversarial checks of the packed fp32 GEMM (kernels/gemm_cpu.py, csrc/gemm_f32.c) and the
``"panels"`` Linear path: an OpenMP team smaller than requested, zero-size K with leading
dimensions, NaN/Inf/-0.0/denormal propagation against F.linear (padding columns of the last
panel included), row-strided x and out (qkv-style splits), concurrent calls from Python threads,
thread-count changes between calls, other x dtypes, the weight read back, pickling, per-expert
Linear over views of a stacked tensor, and a memory-checked (AddressSanitizer) run of the C
kernel over odd shapes, strides, threads and blocking knobs."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cpu_isa import isa  # noqa: F401  (fixture)

from kernels import cpu as kcpu
from kernels import gemm_cpu
from qworker.model import linear
from qworker.model.linear import Linear

CC = os.environ.get("CC", "cc")
pytestmark = pytest.mark.skipif(shutil.which(CC) is None, reason="no C compiler on this machine")
ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(kcpu.__file__).with_name("csrc") / "gemm_f32.c"
HAS_PANELS = linear.panels_supported(torch.float32)[0]


def _close(y, ref, what=""):
    """Same NaN positions, same infinities, finite values within fp32 rounding."""
    assert y.shape == ref.shape, what
    assert torch.equal(torch.isnan(y), torch.isnan(ref)), f"{what}: NaN positions differ"
    fin = torch.isfinite(ref)
    assert torch.equal(y[~fin & ~torch.isnan(ref)], ref[~fin & ~torch.isnan(ref)]), f"{what}: infinities differ"
    torch.testing.assert_close(y[fin], ref[fin], rtol=1e-5, atol=1e-5, msg=what)


_TEAM_SCRIPT = r"""
import torch, torch.nn.functional as F
from kernels import gemm_cpu
assert gemm_cpu.kernel_isa() is not None
g = torch.Generator().manual_seed(0)
bad = []
for M, N, K, threads in [(40, 100, 64, 2), (40, 100, 64, 4), (3, 40, 300, 4), (100, 17, 40, 8)]:
    x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    out = torch.full((M, N), float("nan"))
    gemm_cpu.gemm(x, gemm_cpu.pack_weight(w), b, N, out=out, threads=threads)
    if not torch.allclose(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4):
        bad.append((M, N, K, threads, int(torch.isnan(out).sum())))
print("BAD", bad)
"""


@pytest.mark.parametrize("env", [{"OMP_THREAD_LIMIT": "1"}, {"OMP_THREAD_LIMIT": "2"}], ids=["limit1", "limit2"])
def test_openmp_team_smaller_than_requested(env):
    """OpenMP may give a parallel region fewer threads than num_threads asks for (OMP_THREAD_LIMIT,
    OMP_DYNAMIC on a loaded machine, a call from inside another parallel region): every output
    element must still be computed. Before the fix only thread 0's share was written and the rest
    of y was left uninitialised."""
    e = dict(os.environ, **env)
    r = subprocess.run([sys.executable, "-c", _TEAM_SCRIPT], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "BAD []" in r.stdout, r.stdout


def test_zero_k_with_leading_dims_and_1d(isa):
    """K = 0 (an empty contraction: the bias alone, or zeros) for a 3-D and a 1-D x, as F.linear."""
    N = 5
    packed = gemm_cpu.pack_weight(torch.empty(N, 0))
    b = torch.randn(N)
    for shape in [(2, 3, 0), (0,), (4, 0)]:
        x = torch.empty(shape)
        _close(gemm_cpu.gemm(x, packed, b, N), F.linear(x, torch.empty(N, 0), b), f"bias {shape}")
        _close(gemm_cpu.gemm(x, packed, None, N), F.linear(x, torch.empty(N, 0)), f"no bias {shape}")
    # M = 0 with leading dims
    x = torch.empty(2, 0, 7)
    y = gemm_cpu.gemm(x, gemm_cpu.pack_weight(torch.randn(N, 7)), b, N)
    assert y.shape == (2, 0, N)


@pytest.mark.parametrize("bias", [False, True])
def test_nan_inf_propagation_like_f_linear(isa, bias):
    """A NaN in x gives NaN exactly in that row; Inf gives +-Inf or NaN (Inf - Inf, Inf * 0 on a
    zero weight) exactly where F.linear does; the padding lanes of the last panel (Inf * 0 = NaN
    there) never reach real columns or memory past N."""
    g = torch.Generator().manual_seed(11)
    for M, N, K in [(1, 37, 33), (5, 37, 33), (13, 50, 20), (7, 1, 5), (3, 17, 1), (20, 129, 64)]:
        w = torch.randn(N, K, generator=g)
        w[::3, :] = 0.0  # zero rows: Inf * 0 = NaN in real columns too
        b = torch.randn(N, generator=g) if bias else None
        packed = gemm_cpu.pack_weight(w)
        x = torch.randn(M, K, generator=g)
        x[0, K // 2] = float("inf")
        if M > 1:
            x[1, 0] = float("nan")
        if M > 2:
            x[2, 0] = float("inf")
            x[2, K - 1] = float("-inf") if K > 1 else x[2, 0]
        ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
        for threads in (1, 2):
            buf = torch.full((M, N + 16), 7.0)
            out = buf[:, :N]
            gemm_cpu.gemm(x, packed, b, N, out=out, threads=threads)
            _close(out, ref, f"M={M} N={N} K={K} threads={threads}")
            assert torch.equal(buf[:, N:], torch.full((M, 16), 7.0)), "written past N"
            _close(gemm_cpu.gemm(x, packed, b, N, threads=threads), ref)
            # the torch reference path agrees on the NaN/Inf positions
            _close(F.linear(x, w, b), ref, "F.linear itself")


def test_negative_zero_and_denormals(isa):
    g = torch.Generator().manual_seed(12)
    N, K = 20, 9
    w = torch.randn(N, K, generator=g)
    packed = gemm_cpu.pack_weight(w)
    x = torch.full((3, K), -0.0)
    y = gemm_cpu.gemm(x, packed, None, N)
    assert torch.equal(y, torch.zeros(3, N))  # values (the sign of zero may differ from MKL's)
    tiny = torch.full((4, K), 1e-39)  # denormal inputs, denormal products
    y = gemm_cpu.gemm(tiny, packed, None, N)
    ref = (tiny.double() @ w.double().T)
    assert (y.double() - ref).abs().max().item() <= 1e-44 * K
    assert (y != 0).any()  # not flushed to zero


def test_row_strided_views_qkv_split(isa):
    """x as a column slice of a wider tensor (q, k, v of a fused qkv output: row stride > K and a
    storage offset) and out as a column slice of a wider buffer; rows 1 and many."""
    g = torch.Generator().manual_seed(13)
    q, kv = 48, 16
    for M in (1, 2, 7, 13, 64):
        qkv = torch.randn(M, q + 2 * kv, generator=g)
        qs, ks, vs = qkv.split([q, kv, kv], dim=-1)
        for part, K in ((qs, q), (ks, kv), (vs, kv)):
            N = 35
            w = torch.randn(N, K, generator=g)
            b = torch.randn(N, generator=g)
            packed = gemm_cpu.pack_weight(w)
            ref = F.linear(part.double(), w.double(), b.double()).float()
            buf = torch.full((M, 3 * N), float("nan"))
            out = buf[:, N:2 * N]
            before = qkv.clone()
            for threads in (1, 2, 3):
                assert gemm_cpu.gemm(part, packed, b, N, out=out, threads=threads) is out
                _close(out, ref, f"out M={M} K={K}")
                _close(gemm_cpu.gemm(part, packed, b, N, threads=threads), ref, f"M={M} K={K}")
            assert torch.isnan(buf[:, :N]).all() and torch.isnan(buf[:, 2 * N:]).all()
            assert torch.equal(qkv, before)  # x untouched
    # a transposed x, a stride-0 (expanded) x, a 3-D non-viewable x
    w = torch.randn(21, 10, generator=g)
    packed = gemm_cpu.pack_weight(w)
    for x in (torch.randn(10, 6, generator=g).T, torch.randn(10, generator=g).expand(5, 10),
              torch.randn(4, 6, 10, generator=g)[:, ::2], torch.randn(10, 6, generator=g).T[:1]):
        _close(gemm_cpu.gemm(x, packed, None, 21), F.linear(x, w), str(tuple(x.stride())))


def test_concurrent_calls_from_python_threads(isa):
    """Calls from several Python threads at once (TP followers, background threads), each asking
    for several OpenMP threads: every result right."""
    g = torch.Generator().manual_seed(14)
    cases = []
    for M, N, K in [(1, 300, 64), (9, 100, 96), (40, 70, 50), (3, 1000, 32)]:
        x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
        cases.append((x, gemm_cpu.pack_weight(w), b, N, F.linear(x, w, b)))
    errors: list[str] = []

    def work(i):
        try:
            for r in range(15):
                x, packed, b, N, ref = cases[(i + r) % len(cases)]
                y = gemm_cpu.gemm(x, packed, b, N, threads=2 + (r % 2))
                if not torch.allclose(y, ref, rtol=1e-4, atol=1e-4):
                    errors.append(f"thread {i} round {r}")
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(repr(exc))

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []


def test_torch_thread_count_changes_between_calls(isa):
    g = torch.Generator().manual_seed(15)
    x, w, b = torch.randn(33, 64, generator=g), torch.randn(90, 64, generator=g), torch.randn(90, generator=g)
    packed, ref = gemm_cpu.pack_weight(w), F.linear(x, w, b)
    saved = torch.get_num_threads()
    try:
        for n in (1, 2, 1, 4, 2):
            torch.set_num_threads(n)
            torch.testing.assert_close(gemm_cpu.gemm(x, packed, b, 90), ref, rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(saved)
    for threads in (0, -3, 1, 64):  # nonsense and too many: still right
        torch.testing.assert_close(gemm_cpu.gemm(x, packed, b, 90, threads=threads), ref, rtol=1e-5, atol=1e-5)


def test_other_x_dtypes_and_fallback(monkeypatch):
    """float64 / bf16 x go through torch (in x's dtype); QWORKER_CPU_KERNELS=0 gives the same
    values, NaN positions included, and out= still works there."""
    g = torch.Generator().manual_seed(16)
    N, K = 37, 24
    x, w, b = torch.randn(5, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    x[2, 3] = float("nan")
    packed = gemm_cpu.pack_weight(w)
    y64 = gemm_cpu.gemm(x.double(), packed, b, N)
    assert y64.dtype == torch.float64
    _close(y64, F.linear(x.double(), w.double(), b.double()))
    ybf = gemm_cpu.gemm(x.bfloat16(), packed, b, N)
    assert ybf.dtype == torch.bfloat16
    ref = gemm_cpu.gemm(x, packed, b, N)
    monkeypatch.setenv("QWORKER_CPU_KERNELS", "0")
    _close(gemm_cpu.gemm(x, packed, b, N), ref)
    out = torch.empty(5, N)
    assert gemm_cpu.gemm(x, packed, b, N, out=out) is out
    _close(out, ref)
    _close(gemm_cpu.gemm(x.reshape(5, 1, K), packed, b, N).reshape(5, N), ref)


@pytest.mark.skipif(not HAS_PANELS, reason="no C kernels")
def test_panels_linear_readback_pickle_and_expert_views():
    g = torch.Generator().manual_seed(17)
    # weights as views: one expert of a stacked [E, out, in] tensor, a narrowed TP shard
    stacked = torch.randn(4, 2 * 19, 24, generator=g)
    big = torch.randn(100, 24, generator=g)
    for w in (stacked[2], big[10:47], big[:, :24].T.contiguous().T):
        b = torch.randn(w.shape[0], generator=g)
        lin = Linear(w, b, "panels")
        assert torch.equal(lin.dense_out_in(), w)
        x = torch.randn(6, 24, generator=g)
        with torch.inference_mode():
            y = lin(x)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        back = pickle.loads(pickle.dumps(lin))
        assert back.backend == "panels" and torch.equal(back.dense_out_in(), w)
        with torch.inference_mode():
            assert torch.equal(back(x), y)
        with torch.inference_mode():
            y[0, 0] = 123.0  # the caller owns y (LoRA and TP add into it in place): the next call is fresh
            torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert torch.equal(stacked, stacked.clone())


# ---- memory-checked run of the C kernel (AddressSanitizer + UBSan) ----

_DRIVER = r"""
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int qw_gemm_f32(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy, int64_t M,
                int64_t N, int64_t K, int num_threads, int64_t mc, int64_t group, int64_t kc);
static uint64_t rs = 88172645463325252ull;
static uint64_t rnd(void) { rs ^= rs << 13; rs ^= rs >> 7; rs ^= rs << 17; return rs; }
static float frand(void) { return (float)((rnd() >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f; }
#define SENT 12345.678f
static long fails = 0;
static void run(int64_t M, int64_t N, int64_t K, int64_t ldx, int64_t ldy, int th, int64_t mc, int64_t group,
                int64_t kc, int usebias, int special) {
    const int64_t P = (N + 15) / 16;
    const size_t nx = M > 0 && K > 0 ? (size_t)((M - 1) * ldx + K) : 0;
    float *x = malloc(nx * sizeof(float) + 1), *w = malloc((size_t)(N * K) * sizeof(float) + 1);
    for (size_t i = 0; i < nx; i++) x[i] = frand();
    for (int64_t i = 0; i < N * K; i++) w[i] = frand();
    if (special == 3) for (int64_t n = 0; n < N; n += 3) for (int64_t k = 0; k < K; k++) w[n * K + k] = 0.0f;
    if (special && M > 0 && K > 0) x[(rnd() % M) * ldx + rnd() % K] = special == 1 ? NAN : INFINITY;
    if (special == 2 && M > 0 && K > 0) x[(rnd() % M) * ldx + rnd() % K] = -INFINITY;
    float *wp = malloc((size_t)(P * K * 16) * sizeof(float) + 1);
    for (int64_t p = 0; p < P; p++) for (int64_t k = 0; k < K; k++) for (int c = 0; c < 16; c++)
        wp[(p * K + k) * 16 + c] = p * 16 + c < N ? w[(p * 16 + c) * K + k] : 0.0f;
    float *b = usebias ? malloc((size_t)N * sizeof(float) + 1) : NULL;
    if (b) for (int64_t n = 0; n < N; n++) b[n] = frand();
    const size_t ny = M > 0 ? (size_t)((M - 1) * ldy + N) : 0;
    float *y = malloc(ny * sizeof(float) + 1);
    for (size_t i = 0; i < ny; i++) y[i] = SENT;
    int bad = qw_gemm_f32(x, ldx, wp, b, y, ldy, M, N, K, th, mc, group, kc) != 0;
    for (int64_t i = 0; i < M && !bad; i++) {
        for (int64_t n = 0; n < N && !bad; n++) {
            double r = b ? b[n] : 0.0, mag = fabs(r);
            for (int64_t k = 0; k < K; k++) { double t = (double)x[i * ldx + k] * w[n * K + k]; r += t; mag += fabs(t); }
            float v = y[i * ldy + n];
            bad = isnan(r) ? !isnan(v) : isinf(r) ? v != r : (isnan(v) || fabs(v - r) > 1e-5 * mag + 1e-6);
        }
        for (int64_t n = N; n < ldy && i < M - 1 && !bad; n++) bad = y[i * ldy + n] != SENT;
    }
    if (bad && fails++ < 10)
        fprintf(stderr, "FAIL M=%ld N=%ld K=%ld ldx=%ld ldy=%ld th=%d mc=%ld group=%ld kc=%ld bias=%d special=%d\n",
                (long)M, (long)N, (long)K, (long)ldx, (long)ldy, th, (long)mc, (long)group, (long)kc, usebias, special);
    free(x); free(w); free(wp); free(b); free(y);
}
#define PICK(a) a[rnd() % (sizeof a / sizeof a[0])]
int qw_gemm_f32_isa(void);
int main(int argc, char **argv) {
    long iters = argc > 1 ? atol(argv[1]) : 300;
    printf("isa %d\n", qw_gemm_f32_isa());
    static const int64_t Ms[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 17, 23, 25, 36, 37, 50, 97};
    static const int64_t Ns[] = {1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 100, 129};
    static const int64_t Ks[] = {0, 1, 2, 3, 4, 5, 7, 8, 16, 17, 33, 64, 65};
    static const int64_t knobs[][3] = {{0, 0, 0}, {0, 0, 0}, {1, 1, 1}, {7, 2, 5}, {13, 3, 2}, {0, 1, 3}, {5, 0, 0}};
    for (long it = 0; it < iters; it++) {
        int64_t M = PICK(Ms), N = PICK(Ns), K = PICK(Ks);
        int64_t ldx = K + (rnd() % 3 == 0 ? rnd() % 5 + 1 : 0), ldy = N + (rnd() % 3 == 0 ? rnd() % 5 + 1 : 0);
        const int64_t *kn = knobs[rnd() % 7];
        run(M, N, K, ldx, ldy, 1 + (int)(rnd() % 3), kn[0], kn[1], kn[2], (int)(rnd() & 1), (int)(rnd() % 4));
    }
    run(1, 4096 + 7, 16, 16, 4096 + 7, 2, 0, 0, 0, 1, 0);
    run(1, 40, 4100, 4100, 40, 2, 0, 0, 0, 1, 2);  /* three K blocks */
    run(3, 33, 2049, 2051, 40, 3, 0, 0, 0, 1, 1);
    run(1500, 17, 3, 3, 17, 2, 0, 0, 0, 1, 2);
    run(100, 17, 40, 41, 19, 16, 0, 0, 0, 1, 0);   /* more threads than panels: rows split */
    run(7, 40, 64, 64, 40, 8, 0, 0, 0, 1, 3);      /* uneven row ranges per thread */
    printf("fails %ld\n", fails);
    return fails != 0;
}
"""


# The AVX-512 intrinsics the kernel uses, emulated in plain C: the AVX-512 path's index arithmetic
# (12 x 32 tiles, 1-3 row tiles over 4-8 panels) runs, memory-checked, on a CPU without AVX-512.
_EMU512 = r"""
#include <math.h>
#include <string.h>
#include <xmmintrin.h>
typedef struct { float v[16]; } __m512;
static inline __m512 _mm512_setzero_ps(void) { __m512 r; for (int i = 0; i < 16; i++) r.v[i] = 0.0f; return r; }
static inline __m512 _mm512_loadu_ps(const float *p) { __m512 r; memcpy(r.v, p, sizeof r.v); return r; }
static inline void _mm512_storeu_ps(float *p, __m512 a) { memcpy(p, a.v, sizeof a.v); }
static inline __m512 _mm512_set1_ps(float f) { __m512 r; for (int i = 0; i < 16; i++) r.v[i] = f; return r; }
static inline __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) {
    __m512 r; for (int i = 0; i < 16; i++) r.v[i] = fmaf(a.v[i], b.v[i], c.v[i]); return r;
}
"""
_AVX512_GUARD = "#if defined(__AVX512F__) && defined(QW_GEMM_AVX512)\n#include <immintrin.h>\n"


@pytest.mark.parametrize("variant", ["avx2", "generic", "avx512-emulated"])
def test_kernel_under_address_sanitizer(tmp_path, variant):
    """Exact-size heap buffers for x, the packed weight, bias and y (rows ldx/ldy apart, sentinels
    in the row gaps): no out-of-bounds access, no undefined behaviour, right values, NaN/Inf where
    the float64 reference has them, over odd M, N, K, strides, threads and blocking knobs."""
    if variant == "avx2" and "avx2" not in kcpu.available_isas():
        pytest.skip("no AVX2 on this CPU")
    source, flags = SOURCE, {"avx2": ["-march=native", "-mno-avx512f"], "generic": ["-march=native", "-mno-avx"]}.get(variant, [])
    if variant == "avx512-emulated":
        text = SOURCE.read_text()
        assert text.count(_AVX512_GUARD) == 1, "gemm_f32.c's AVX-512 guard changed: update this test"
        (tmp_path / "emu512.h").write_text(_EMU512)
        source = tmp_path / "gemm_emu512.c"
        source.write_text(text.replace(_AVX512_GUARD, '#if 1\n#include "emu512.h"\n'))
    (tmp_path / "driver.c").write_text(_DRIVER)
    exe = tmp_path / "driver"
    # -O0 for the emulated build: gcc takes ~30 s to optimise its unrolled struct-vector tiles
    cmd = [CC, "-O0" if variant == "avx512-emulated" else "-O1", "-g", *flags, "-fno-trapping-math", "-fopenmp", "-std=gnu11",
           "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
           "-o", str(exe), str(source), str(tmp_path / "driver.c"), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and "sanitize" in r.stderr:
        pytest.skip(f"{CC} cannot build with -fsanitize=address: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0", UBSAN_OPTIONS="print_stacktrace=1")
    env.pop("LD_PRELOAD", None)
    r = subprocess.run([str(exe), "300"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "fails 0" in r.stdout, (r.stdout + r.stderr)[-3000:]
    isa_of = {"avx2": 1, "generic": 0, "avx512-emulated": 2}[variant]
    assert f"isa {isa_of}" in r.stdout


def test_avx512_kernel_under_address_sanitizer(tmp_path):
    """The real AVX-512 micro-kernel (built with -DQW_GEMM_AVX512, as the avx512 build is), under
    the sanitizers, on this CPU."""
    if "avx512" not in kcpu.available_isas():
        pytest.skip("this CPU has no AVX-512 (the emulated build above checks the kernel's tiling)")
    (tmp_path / "driver.c").write_text(_DRIVER)
    exe = tmp_path / "driver"
    cmd = [CC, "-O2", "-g", "-march=native", "-DQW_GEMM_AVX512", "-fno-trapping-math", "-fopenmp", "-std=gnu11",
           "-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-o", str(exe), str(SOURCE), str(tmp_path / "driver.c"), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0")
    env.pop("LD_PRELOAD", None)
    r = subprocess.run([str(exe), "2000"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "fails 0" in r.stdout and "isa 2" in r.stdout, (r.stdout + r.stderr)[-3000:]
