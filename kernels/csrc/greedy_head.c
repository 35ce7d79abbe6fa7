/*
 * The bounded greedy head's row pass (kernels/greedy_head.py): given approximate logits a[r, j]
 * (a bf16 GEMM) and, for every entry, a bound b[r, j] = s[r] * wn[j] + eps[r] on its distance to
 * the exact fp32 logit e[r, j], the token of each row:
 *
 *   L[r]   = max_j a[r, j] - b[r, j]            (a lower bound on max_j e[r, j])
 *   cand   = { j : a[r, j] + b[r, j] >= L[r] }  (every other column is strictly below the max)
 *
 * One candidate (the usual case) is the token. Several are computed exactly, panel by panel, with
 * the fp32 GEMM's own arithmetic (qw_gemm_f32_panel_row, csrc/gemm_f32.c: the same bits as the
 * full head), and the first of their maxima is the token, as the full head's argmax. A row gets -1
 * (the caller runs the full head for it) when a value or bound is not finite, when it has more
 * than QW_GREEDY_CAP candidates, or when an exact value is NaN. The caller has inflated s and eps
 * so that the float rounding of a - b and a + b here can only widen the interval.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* L for one row, or NaN when a value or bound is not finite. */
static float lower_max(const float *restrict a, const float *restrict wn, int64_t cols, float s, float eps) {
    int64_t j = 0;
    float m = -INFINITY;
    int bad = 0;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY);
    const __m512 vs = _mm512_set1_ps(s), veps = _mm512_set1_ps(eps), vmaxf = _mm512_set1_ps(3.4028234663852886e38f);
    __mmask16 vbad = 0;
    for (; j + 16 <= cols; j += 16) {
        const __m512 va = _mm512_loadu_ps(a + j);
        const __m512 vb = _mm512_fmadd_ps(vs, _mm512_loadu_ps(wn + j), veps);
        /* |a| <= FLT_MAX and b <= FLT_MAX are false for NaN and infinities */
        vbad |= ~_mm512_cmp_ps_mask(_mm512_abs_ps(va), vmaxf, _CMP_LE_OQ);
        vbad |= ~_mm512_cmp_ps_mask(vb, vmaxf, _CMP_LE_OQ);
        vm = _mm512_max_ps(vm, _mm512_sub_ps(va, vb));
    }
    bad = vbad != 0;
    m = _mm512_reduce_max_ps(vm);
#endif
    for (; j < cols; j++) {
        const float b = fmaf(s, wn[j], eps), lb = a[j] - b;
        if (!(fabsf(a[j]) <= 3.4028234663852886e38f) || !(b <= 3.4028234663852886e38f)) bad = 1;
        if (lb > m) m = lb;
    }
    return bad ? NAN : m;
}

/* The candidates of one row into out[0 .. cap); their number, or -1 past cap. */
static int32_t collect(const float *restrict a, const float *restrict wn, int64_t cols, float s, float eps, float floor_,
                       int64_t *restrict out, int64_t cap) {
    int64_t n = 0, j = 0;
#if defined(__AVX512F__)
    const __m512 vs = _mm512_set1_ps(s), veps = _mm512_set1_ps(eps), vfloor = _mm512_set1_ps(floor_);
    for (; j + 16 <= cols; j += 16) {
        const __m512 vub = _mm512_add_ps(_mm512_loadu_ps(a + j), _mm512_fmadd_ps(vs, _mm512_loadu_ps(wn + j), veps));
        unsigned hits = _mm512_cmp_ps_mask(vub, vfloor, _CMP_GE_OQ);
        while (hits) {
            if (n == cap) return -1;
            out[n++] = j + __builtin_ctz(hits);
            hits &= hits - 1;
        }
    }
#endif
    for (; j < cols; j++) {
        if (a[j] + fmaf(s, wn[j], eps) >= floor_) {
            if (n == cap) return -1;
            out[n++] = j;
        }
    }
    return (int32_t)n;
}

#define QW_GREEDY_CAP 64

void qw_gemm_f32_panel_row(const float *x, const float *w, int64_t K, float *out);

/* The first maximum of the exact values of n ascending candidates, or -1 for a NaN. */
static int64_t best_exact(const int64_t *cand, int32_t n, const float *x, int64_t K, const float *panels) {
    float vals[16];
    int64_t panel = -1, best = -1;
    float top = 0.0f;
    for (int32_t i = 0; i < n; i++) {
        const int64_t j = cand[i];
        if (j / 16 != panel) {
            panel = j / 16;
            qw_gemm_f32_panel_row(x, panels + panel * K * 16, K, vals);
        }
        const float v = vals[j % 16];
        if (v != v) return -1;
        if (best < 0 || v > top) { best = j; top = v; }
    }
    return best;
}

void qw_greedy_head_f32(const float *a, int64_t rows, int64_t cols, int64_t lda, const float *wn, const float *s,
                        const float *eps, const float *x, int64_t ldx, int64_t K, const float *panels, int64_t *tokens,
                        int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols >= (1 << 18))
    for (int64_t r = 0; r < rows; r++) {
        const float *row = a + r * lda;
        const float floor_ = cols > 0 ? lower_max(row, wn, cols, s[r], eps[r]) : NAN;
        int64_t cand[QW_GREEDY_CAP];
        const int32_t n = floor_ == floor_ && floor_ > -INFINITY ? collect(row, wn, cols, s[r], eps[r], floor_, cand, QW_GREEDY_CAP) : -1;
        tokens[r] = n == 1 ? cand[0] : n > 1 ? best_exact(cand, n, x + r * ldx, K, panels) : -1;
    }
}
