/*
 * Paged extend (prefill) attention over a bf16 cache with its two products in bf16, for the CPU
 * bf16 mode (the model's activations are bf16): the same call, inputs and checks as
 * csrc/paged_extend.c's qw_paged_extend_bf16, whose fp32 arithmetic spends ~20% of a bf16 prefill
 * step on the two products alone. The products run on AMX tiles where the CPU and OS give AMX
 * (Sapphire Rapids and later), else as AVX512_BF16 dot products (VDPBF16PS: Zen 4, Cooper Lake).
 *
 * Precision, as torch's bf16 flash attention and vLLM's AMX kernel: the scaled queries and the
 * softmax probabilities are rounded to bf16 (nearest even) for the products; the products are
 * summed in fp32 (TDPBF16PS / VDPBF16PS, which both read and write bf16/fp32 subnormals as zero),
 * the softmax runs in fp32, and each row is normalised by the sum of the rounded probabilities it
 * was multiplied by. So results differ from qw_paged_extend_bf16's by bf16 rounding, not more; an
 * fp32 model with a bf16 cache keeps that kernel. The two product back-ends sum in different
 * orders, so their bits differ from each other (each is deterministic: a row's result depends on
 * its own sequence only, never on the batch, the work split or the thread count).
 *
 * Work is split as there (csrc/paged_extend_plan.h): an item is (sequence, KV head, tile of query
 * rows); its G query heads x rows form a block of rows (padded to whole 16-row tiles) that walks
 * the keys it can see in chunks of NK = 32. Per chunk:
 *   K is transposed into pairs, Kb[D / 2][NK] (one 32-bit (d, d + 1) pair per key: AMX's B layout,
 *   and the operand a broadcast query pair meets in VDPBF16PS),
 *   V interleaved, Vb[NK / 2][D][2] (keys j, j + 1 per column d);
 *   S = Q . K^T;
 *   an online softmax per row in fp32 (window, softcap and causal limits as paged_extend_impl.h),
 *   probabilities rounded to bf16 into P [rows][NK];
 *   P . V added to the row's fp32 output after the running max's rescale.
 * Keys past the chunk's end are zeros in Kb/Vb with probability 0, so no garbage is ever read.
 *
 * Falls back to qw_paged_extend_bf16 (same arguments) where neither back-end applies: a build
 * without AVX512_BF16, or D not a multiple of 32. qw_paged_extend_bf16_products_kernel says which
 * runs.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "paged_extend_plan.h"

int qw_paged_extend_bf16(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int32_t *block_tables, int64_t table_stride, const int32_t *query_start_loc,
                         const int32_t *seq_lens, float *out, int64_t out_stride, int B, int Hq, int Hkv, int D,
                         int block_size, float scale, int num_threads, int64_t num_blocks, int window, float softcap,
                         const float *sinks);
int qw_gemm_bf16_amx_ready(void);

/* the dot-product back-end: any build whose CPU has AVX512_BF16 */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define QW_X_DP 1
#include <immintrin.h>
#else
#define QW_X_DP 0
#endif
/* the AMX back-end: the avx512 build of an AMX CPU (it has AVX512_BF16 too) */
#if QW_X_DP && defined(QW_GEMM_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QW_X_AMX 1
#else
#define QW_X_AMX 0
#endif

#if QW_X_DP
#define NK 32 /* keys per chunk: two 16-key C tiles (two vectors) for S, one 32-key product for P . V */
#define TR 16 /* rows per AMX tile; the block of rows is padded to whole tiles */

/* The chunk of keys [c0, c0 + NK) of KV head h into Kb (uint32 pairs, [D / 2][NK]) and Vb
 * ([NK / 2][D][2]): key t in slot t - c0, the keys outside [a, e) (before a window's first key,
 * past the context) zero. Slots follow positions, so the P . V pairs are keys (c0 + 2m, c0 + 2m + 1)
 * (c0 a multiple of NK) wherever a window starts and however a prompt was split into steps. */
static void load_chunk(const uint16_t *k_cache, const uint16_t *v_cache, const int32_t *table, int c0, int a, int e,
                       int block_size, int64_t token_stride, int h, int D, uint32_t *restrict Kb, uint16_t *restrict Vb) {
    /* vpermw index interleaving two 16-value rows a (0..15) and b (16..31): a0 b0 a1 b1 ... */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int Dp = D / 2;
    for (int j = 0; j < NK; j += 2) {
        const uint16_t *kr[2], *vr[2];
        for (int u = 0; u < 2; u++) {
            const int t = c0 + j + u;
            if (t >= a && t < e) {
                const int64_t at = ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride + (int64_t)h * D;
                kr[u] = k_cache + at;
                vr[u] = v_cache + at;
            } else {
                kr[u] = vr[u] = NULL;
            }
        }
        for (int u = 0; u < 2; u++) {
            if (kr[u]) {
                uint32_t pair;
                for (int p = 0; p < Dp; p++) {
                    memcpy(&pair, kr[u] + 2 * p, 4);
                    Kb[(int64_t)p * NK + j + u] = pair;
                }
            } else {
                for (int p = 0; p < Dp; p++) Kb[(int64_t)p * NK + j + u] = 0;
            }
        }
        uint16_t *dst = Vb + (int64_t)(j / 2) * D * 2;
        for (int d = 0; d < D; d += 16) {
            const __m256i a = vr[0] ? _mm256_loadu_si256((const __m256i *)(vr[0] + d)) : _mm256_setzero_si256();
            const __m256i b = vr[1] ? _mm256_loadu_si256((const __m256i *)(vr[1] + d)) : _mm256_setzero_si256();
            const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
            _mm512_storeu_si512(dst + 2 * d, _mm512_permutexvar_epi16(pairs, ab));
        }
    }
}

/* The dot-product back-end. Each output starts from zero and adds its pairs in order, one
 * VDPBF16PS each: scores over the D / 2 channel pairs, P . V over the NK / 2 key pairs. */

/* S rows [r, r + R) = Q . K^T: a query's (d, d + 1) pair broadcast against Kb[d / 2]'s 32 keys */
static inline __attribute__((always_inline)) void scores_dp_rows(const uint16_t *restrict Qb, const uint32_t *restrict Kb,
                                                                int D, int r, const int R, float *restrict S) {
    __m512 acc[12][2];
#pragma GCC unroll 12
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; p++) {
        const __m512i k0 = _mm512_loadu_si512(Kb + (int64_t)p * NK), k1 = _mm512_loadu_si512(Kb + (int64_t)p * NK + 16);
#pragma GCC unroll 12
        for (int i = 0; i < R; i++) {
            uint32_t pair;
            memcpy(&pair, Qb + (int64_t)(r + i) * D + 2 * p, sizeof pair);
            const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], qp, (__m512bh)k0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], qp, (__m512bh)k1);
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < R; i++) {
        _mm512_storeu_ps(S + (int64_t)(r + i) * NK, acc[i][0]);
        _mm512_storeu_ps(S + (int64_t)(r + i) * NK + 16, acc[i][1]);
    }
}

/* S rows [r0, r1): 12 rows at a time (24 sums, 2 key loads and 12 broadcasts per 24 products) */
static void scores_dp(const uint16_t *Qb, const uint32_t *Kb, int D, int r0, int r1, float *S) {
    int r = r0;
    for (; r + 12 <= r1; r += 12) scores_dp_rows(Qb, Kb, D, r, 12, S);
    switch (r1 - r) { /* the rest, with a tile of its own size */
#define QW_REST(n) case n: scores_dp_rows(Qb, Kb, D, r, n, S); break;
        QW_REST(1) QW_REST(2) QW_REST(3) QW_REST(4) QW_REST(5) QW_REST(6)
        QW_REST(7) QW_REST(8) QW_REST(9) QW_REST(10) QW_REST(11)
#undef QW_REST
        default: break;
    }
}

/* O rows [r, r + R), columns [c0 * 16, (c0 + NC) * 16): O = O * alpha + P . V, a row's
 * probability pair (keys 2m, 2m + 1) broadcast against Vb[m]'s columns */
static inline __attribute__((always_inline)) void add_pv_dp_tile(const uint16_t *restrict Pb, const uint16_t *restrict Vb,
                                                                int D, int r, const int R, int c0, const int NC,
                                                                const float *restrict alpha, float *restrict O) {
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < R; i++)
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) acc[i][c] = _mm512_setzero_ps();
    for (int m = 0; m < NK / 2; m++) {
        __m512i v[4];
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) v[c] = _mm512_loadu_si512(Vb + ((int64_t)m * D + (c0 + c) * 16) * 2);
#pragma GCC unroll 6
        for (int i = 0; i < R; i++) {
            uint32_t pair;
            memcpy(&pair, Pb + (int64_t)(r + i) * NK + 2 * m, sizeof pair);
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
#pragma GCC unroll 4
            for (int c = 0; c < NC; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], pp, (__m512bh)v[c]);
        }
    }
#pragma GCC unroll 6
    for (int i = 0; i < R; i++) {
        float *restrict o = O + (int64_t)(r + i) * D + c0 * 16;
        const __m512 a = _mm512_set1_ps(alpha[r + i]);
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16 * c), a, acc[i][c]));
    }
}

static inline __attribute__((always_inline)) void add_pv_dp_rows(const uint16_t *Pb, const uint16_t *Vb, int D, int r,
                                                                const int R, const float *alpha, float *O) {
    const int ncol = D / 16;
    int c0 = 0;
    for (; c0 + 4 <= ncol; c0 += 4) add_pv_dp_tile(Pb, Vb, D, r, R, c0, 4, alpha, O);
    if (ncol - c0 == 2) add_pv_dp_tile(Pb, Vb, D, r, R, c0, 2, alpha, O); /* D % 32 == 0: 0 or 2 left */
}

/* O rows [r0, r1): 6 rows by 4 column vectors at a time (24 sums, 4 V loads and 6 broadcasts
 * per 24 products) */
static void add_pv_dp(const uint16_t *Pb, const uint16_t *Vb, int D, int r0, int r1, const float *alpha, float *O) {
    int r = r0;
    for (; r + 6 <= r1; r += 6) add_pv_dp_rows(Pb, Vb, D, r, 6, alpha, O);
    switch (r1 - r) {
#define QW_REST(n) case n: add_pv_dp_rows(Pb, Vb, D, r, n, alpha, O); break;
        QW_REST(1) QW_REST(2) QW_REST(3) QW_REST(4) QW_REST(5)
#undef QW_REST
        default: break;
    }
}

#if QW_X_AMX
/* The AMX back-end. */
#include "amx_tiles.h"

/* S[t rows][NK] = Q rows [16 t, 16 t + 16) . K^T for row tiles [t0, t1): C tiles 0-1, A 4, B 5-6 */
static void scores_amx(const uint16_t *Qb, const uint32_t *Kb, int D, int t0, int t1, float *S) {
    for (int t = t0; t < t1; t++) {
        _tile_zero(0);
        _tile_zero(1);
        for (int kb = 0; kb < D / 32; kb++) {
            _tile_loadd(4, Qb + (int64_t)t * TR * D + kb * 32, D * 2);
            _tile_loadd(5, Kb + (int64_t)kb * 16 * NK, NK * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, Kb + (int64_t)kb * 16 * NK + 16, NK * 4);
            _tile_dpbf16ps(1, 4, 6);
        }
        _tile_stored(0, S + (int64_t)t * TR * NK, NK * 4);
        _tile_stored(1, S + (int64_t)t * TR * NK + 16, NK * 4);
        TILES_STORED();
    }
}

/* O[r] = O[r] * alpha[r] + P[r] . V for the rows of tiles [t0, t1): C tiles 0-3 (16 columns
 * each), A 4, B 5; tmp holds 16 x 64 fp32 sums */
static void add_pv_amx(const uint16_t *Pb, const uint16_t *Vb, int D, int t0, int t1, const float *alpha, float *O,
                   float *restrict tmp) {
    const int ncol = D / 16;
    for (int t = t0; t < t1; t++) {
        for (int c0 = 0; c0 < ncol; c0 += 4) {
            const int nc = ncol - c0 < 4 ? ncol - c0 : 4;
            _tile_loadd(4, Pb + (int64_t)t * TR * NK, NK * 2);
            /* tile numbers must be constants: one branch per column count */
            _tile_zero(0);
            _tile_loadd(5, Vb + (int64_t)(c0 + 0) * 32, D * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_stored(0, tmp, 64 * 4);
            if (nc > 1) {
                _tile_zero(1);
                _tile_loadd(5, Vb + (int64_t)(c0 + 1) * 32, D * 4);
                _tile_dpbf16ps(1, 4, 5);
                _tile_stored(1, tmp + 16, 64 * 4);
            }
            if (nc > 2) {
                _tile_zero(2);
                _tile_loadd(5, Vb + (int64_t)(c0 + 2) * 32, D * 4);
                _tile_dpbf16ps(2, 4, 5);
                _tile_stored(2, tmp + 32, 64 * 4);
            }
            if (nc > 3) {
                _tile_zero(3);
                _tile_loadd(5, Vb + (int64_t)(c0 + 3) * 32, D * 4);
                _tile_dpbf16ps(3, 4, 5);
                _tile_stored(3, tmp + 48, 64 * 4);
            }
            TILES_STORED();
            for (int i = 0; i < TR; i++) {
                const int r = t * TR + i;
                float *restrict o = O + (int64_t)r * D + c0 * 16;
                const __m512 a = _mm512_set1_ps(alpha[r]);
                for (int c = 0; c < nc; c++)
                    _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16 * c), a, _mm512_loadu_ps(tmp + i * 64 + 16 * c)));
            }
        }
    }
}

#endif /* QW_X_AMX */

/* Scratch per thread, in bf16 elements where noted (sizes for Rpad rows). */
typedef struct {
    uint16_t *Qb, *Pb, *Vb; /* [Rpad][D], [Rpad][NK], [NK / 2][D][2] */
    uint32_t *Kb;           /* [D / 2][NK] */
    float *S, *O, *m, *l, *alpha, *tmp; /* [Rpad][NK], [Rpad][D], [Rpad] x 3, [16][64] (AMX's C tiles) */
} scratch_t;

static void *scratch_alloc(scratch_t *s, int Rpad, int D) {
    const size_t qb = (size_t)Rpad * D * 2, pb = (size_t)Rpad * NK * 2, vb = (size_t)NK * D * 2, kb = (size_t)D / 2 * NK * 4;
    const size_t sf = (size_t)Rpad * NK * 4, of = (size_t)Rpad * D * 4, rf = (size_t)Rpad * 4 * 3, tf = 16 * 64 * 4;
    const size_t round = 64, total = qb + pb + vb + kb + sf + of + rf + tf + 8 * round;
    char *base = aligned_alloc(64, (total + 63) / 64 * 64);
    if (!base) return NULL;
    char *at = base;
#define TAKE(field, type, bytes) (s->field = (type *)at, at += ((bytes) + round - 1) / round * round)
    TAKE(Qb, uint16_t, qb);
    TAKE(Pb, uint16_t, pb);
    TAKE(Vb, uint16_t, vb);
    TAKE(Kb, uint32_t, kb);
    TAKE(S, float, sf);
    TAKE(O, float, of);
    TAKE(m, float, (size_t)Rpad * 4);
    TAKE(l, float, (size_t)Rpad * 4);
    TAKE(alpha, float, (size_t)Rpad * 4);
    TAKE(tmp, float, tf);
#undef TAKE
    return base;
}

/* One item: query rows [i0, i1) of a sequence (positions prefix + i), KV head h, its G query heads;
 * block rows r = (i - i0) * G + g. amx: the products on tiles (whole 16-row tiles, the rows
 * outside a chunk's [r0, r1) given probability 0 and no rescale), else dot products (rows [r0, r1)). */
static void extend_item(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                        const int32_t *table, int row0, int prefix, int i0, int i1, int h, int G, int D, int block_size,
                        int64_t token_stride, float scale, int window, float softcap, const float *sinks, float *out,
                        int64_t out_stride, const scratch_t *w, int amx) {
    const int nrow = i1 - i0, R = nrow * G, Rpad = (R + TR - 1) / TR * TR;
    for (int i = 0; i < nrow; i++) {
        const float *src = q + (int64_t)(row0 + i0 + i) * q_stride + (int64_t)h * G * D;
        uint16_t *dst = w->Qb + (int64_t)i * G * D;
        for (int e = 0; e < G * D; e++) dst[e] = f32_to_bf16(src[e] * scale);
    }
    memset(w->Qb + (int64_t)R * D, 0, (size_t)(Rpad - R) * D * 2);
    memset(w->O, 0, sizeof(float) * (size_t)Rpad * D);
    for (int r = 0; r < Rpad; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    int kmin, kend, a, e, ilo, ihi;
    qw_x_keys(prefix, i0, i1, window, &kmin, &kend);
    for (int c0 = kmin / NK * NK; c0 < kend; c0 += NK) {
        if (!qw_x_chunk(c0, NK, kmin, kend, prefix, i0, i1, window, &a, &e, &ilo, &ihi)) continue;
        load_chunk(k_cache, v_cache, table, c0, a, e, block_size, token_stride, h, D, w->Kb, w->Vb);
        const int r0 = (ilo - i0) * G, r1 = (ihi - i0) * G, t0 = r0 / TR, t1 = (r1 + TR - 1) / TR;
        const int lo = amx ? t0 * TR : r0, hi = amx ? t1 * TR : r1; /* the rows the products cover */
#if QW_X_AMX
        if (amx) scores_amx(w->Qb, w->Kb, D, t0, t1, w->S);
        else
#endif
            scores_dp(w->Qb, w->Kb, D, r0, r1, w->S);
        for (int r = lo; r < hi; r++) {
            float *restrict s = w->S + (int64_t)r * NK;
            uint16_t *restrict p = w->Pb + (int64_t)r * NK;
            if (r < r0 || r >= r1) { /* a row of the tile that sees none of these keys (or padding) */
                memset(p, 0, NK * 2);
                w->alpha[r] = 1.0f;
                continue;
            }
            /* the row's keys as slots of the chunk: [j0, j1), j0 >= a - c0 (a row's window never
             * starts before the item's first key) */
            const int pos = prefix + i0 + r / G;
            const int j1 = (pos + 1 < e ? pos + 1 : e) - c0;
            const int j0 = window > 0 && pos - window + 1 > c0 ? pos - window + 1 - c0 : 0;
            if (softcap > 0.0f) {
#pragma omp simd
                for (int j = 0; j < NK; j++) s[j] = qw_softcap(s[j], softcap);
            }
            /* the row's keys [j0, j1) of the chunk as two 16-key masks */
            const uint32_t keys = (j1 >= 32 ? 0xffffffffu : (1u << j1) - 1u) & ~((1u << j0) - 1u);
            const __mmask16 k0 = (__mmask16)keys, k1 = (__mmask16)(keys >> 16);
            const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16), ninf = _mm512_set1_ps(-INFINITY);
            const float cm = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(ninf, k0, s0), _mm512_mask_mov_ps(ninf, k1, s1)));
            const float mn = cm > w->m[r] ? cm : w->m[r];
            /* m = -inf at first: alpha ~ 0 scales zeros; an unchanged finite max: exactly e^0 = 1
             * without the scalar exponential (most rows after their first chunks) */
            w->alpha[r] = mn == w->m[r] && mn > -INFINITY ? 1.0f : exp_nonpositive(w->m[r] - mn);
            w->m[r] = mn;
            const __m512 mv = _mm512_set1_ps(mn);
            const __m512i p0 = round_bf16_16(_mm512_maskz_mov_ps(k0, exp_nonpositive16(_mm512_sub_ps(s0, mv))));
            const __m512i p1 = round_bf16_16(_mm512_maskz_mov_ps(k1, exp_nonpositive16(_mm512_sub_ps(s1, mv))));
            /* the row is normalised by the sum of the rounded probabilities it is multiplied by */
            const float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_castsi512_ps(p0), _mm512_castsi512_ps(p1)));
            _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(p0, 16)));
            _mm256_storeu_si256((__m256i *)(p + 16), _mm512_cvtepi32_epi16(_mm512_srli_epi32(p1, 16)));
            w->l[r] = w->l[r] * w->alpha[r] + sum;
        }
#if QW_X_AMX
        if (amx) add_pv_amx(w->Pb, w->Vb, D, t0, t1, w->alpha, w->O, w->tmp);
        else
#endif
            add_pv_dp(w->Pb, w->Vb, D, r0, r1, w->alpha, w->O);
    }
    for (int i = 0; i < nrow; i++)
        for (int g = 0; g < G; g++) {
            const int r = i * G + g;
            const float inv = 1.0f / (w->l[r] + qw_x_sink_term(sinks, h * G + g, w->m[r]));
            float *dst = out + (int64_t)(row0 + i0 + i) * out_stride + (int64_t)(h * G + g) * D;
#pragma omp simd
            for (int d = 0; d < D; d++) dst[d] = w->O[(int64_t)r * D + d] * inv;
        }
}
#endif

/* Which back-end runs for head size D: 2 AMX, 1 dot products, 0 neither (the fp32-product kernel). */
int qw_paged_extend_bf16_products_kernel(int D) {
#if QW_X_DP
    if (D % 32 != 0 || D <= 0) return 0;
#if QW_X_AMX
    /* 2: the OS gave this process AMX state (1 there means only the dot-product GEMM is built) */
    if (qw_gemm_bf16_amx_ready() == 2) return 2;
#endif
    return 1;
#else
    (void)D;
    return 0;
#endif
}

/* Returns 0; -1 when scratch memory could not be allocated (the caller falls back); -2, before
 * reading anything, for a block-table entry outside the cache or more query rows than tokens. */
int qw_paged_extend_bf16_products(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                                  const int32_t *block_tables, int64_t table_stride, const int32_t *query_start_loc,
                                  const int32_t *seq_lens, float *out, int64_t out_stride, int B, int Hq, int Hkv, int D,
                                  int block_size, float scale, int num_threads, int64_t num_blocks, int window,
                                  float softcap, const float *sinks) {
#if QW_X_DP
    const int kernel = Hkv > 0 && Hq % Hkv == 0 ? qw_paged_extend_bf16_products_kernel(D) : 0;
    if (kernel) {
        const int G = Hq / Hkv, amx = kernel == 2;
        const int tm = qw_x_rows_per_item(G);
        qw_x_item *items;
        const int64_t n_items = qw_x_plan(B, Hkv, tm, block_size, window, num_blocks, block_tables, table_stride,
                                          query_start_loc, seq_lens, &items);
        if (n_items <= 0) return (int)n_items;
        const int Rpad = (tm * G + TR - 1) / TR * TR;
        const int64_t token_stride = (int64_t)Hkv * D;
        int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
        {
            scratch_t w;
            void *base = scratch_alloc(&w, Rpad, D);
            if (!base) failed = 1;
#if QW_X_AMX
            else if (amx) qw_configure_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
            for (int64_t it = 0; it < n_items; it++) {
                if (!base) continue;
                const qw_x_item x = items[it];
                extend_item(q, q_stride, k_cache, v_cache, block_tables + x.b * table_stride, query_start_loc[x.b],
                            seq_lens[x.b] - (query_start_loc[x.b + 1] - query_start_loc[x.b]), x.i0, x.i1, x.h, G, D,
                            block_size, token_stride, scale, window, softcap, sinks, out, out_stride, &w, amx);
            }
#if QW_X_AMX
            if (base && amx) _tile_release();
#endif
            free(base);
        }
        free(items);
        return failed ? -1 : 0;
    }
#endif
    return qw_paged_extend_bf16(q, q_stride, k_cache, v_cache, block_tables, table_stride, query_start_loc, seq_lens, out,
                                out_stride, B, Hq, Hkv, D, block_size, scale, num_threads, num_blocks, window, softcap, sinks);
}
