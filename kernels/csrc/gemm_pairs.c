/*
 * bf16 GEMM with AVX512_BF16 dot products on AMX's weight layout, for CPUs that have AVX512_BF16
 * but no AMX (Zen 4 and later; Cooper Lake): y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x bf16.
 * csrc/gemm_amx.c's qw_gemm_bf16_amx runs this where the OS gives no AMX state, so the CPU bf16
 * mode packs its weights in one layout on both kinds of CPU (kernels/gemm_cpu.py pack_weight):
 *
 *   wp [P = ceil(N / 16)][K / 2][16][2] uint16 (bf16 bits)   wp[p][k2][c][j] = W[16p + c][2 k2 + j]
 *
 * One 64-byte load is a panel's 16 columns by a k pair, already in the pairs VDPBF16PS multiplies:
 * csrc/gemm_bf16.c's dot-product kernel reads the panels layout and interleaves every pair of
 * panel rows in a register (a VPERMT2W per 16 columns and 2 k), and its 6 x 16 tile keeps 6 of the
 * 32 vector registers as sums. Here the main tile is 6 rows by 4 panels (24 sums, 4 weight loads
 * and 6 broadcasts per 24 dot products). On a 2-vCPU Zen 4 (docs/benchmarks.md) the model's bf16
 * projections ran 1.05x / 1.24x / 1.29x as fast as on the panels kernel at 48 / 128 / 512 rows
 * (level at 1-16 rows, where both stream the weights).
 *
 * Results are bit for bit csrc/gemm_bf16.c's dot-product kernel's: each output starts from its
 * bias (fp32, or bf16 widened) and adds the pairs (k, k + 1), k = 0, 2, .. K - 2, in order, one
 * VDPBF16PS each, in one fp32 sum; a bf16 y is that sum rounded to nearest even (NaN -> 0x7fc0).
 * So a row's result depends on nothing else in the batch, and the CPU bf16 mode's outputs do not
 * change with the layout. K must be a multiple of 32 (the layout's); the instruction reads bf16
 * denormals as zero.
 *
 * Threads split the panels evenly (one panel finer than the tile: 36 panels over 2 threads are
 * 18 + 18, where whole 4-panel tiles made 20 + 16 and one thread waited for the other), and the
 * rows too when there are fewer panels than threads; each thread walks its panels 4 at a time
 * (their weights, 4 x K x 32 bytes, stay in L2 while every row tile passes over them), a narrower
 * tile at the end of its share. Prefetching the next 4 panels' weights spread over the row tiles
 * (as csrc/gemm_bf16.c does) moved nothing beyond this machine's noise at 16-48 rows: not kept.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "bf16.h"

#if defined(QW_GEMM_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define QW_PAIRS_DOT 1
#include <immintrin.h>
#else
#define QW_PAIRS_DOT 0
#endif

#define NR 16  /* columns per panel */
#define MR 6   /* rows of the main tile */
#define NPM 4  /* panels of the main tile */

#if QW_PAIRS_DOT
typedef void (*pairs_tile_fn)(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t pstride, int64_t K,
                              const float *bias, void *y, int64_t ldy, int ybf, int ncols);

/* rows [0, R) x panels [0, NP) from w (panel j at w + j * pstride); bias: this tile's first column
 * in a zero-padded fp32 row, or NULL; ncols: the columns of y the tile owns (the last panel may be
 * partial) */
#define DEF_PAIRS_TILE(R, NP)                                                                                       \
    static void pairs_tile_##R##_##NP(const uint16_t *restrict x, int64_t ldx, const uint16_t *restrict w,          \
                                      int64_t pstride, int64_t K, const float *restrict bias, void *restrict y,     \
                                      int64_t ldy, int ybf, int ncols) {                                            \
        __m512 acc[R][NP];                                                                                          \
        _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++) {                                                      \
            const __m512 b0 = bias ? _mm512_loadu_ps(bias + j * NR) : _mm512_setzero_ps();                          \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) acc[i][j] = b0;                                     \
        }                                                                                                           \
        for (int64_t k = 0; k < K; k += 2, w += 2 * NR) {                                                           \
            __m512i wv[NP];                                                                                         \
            _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++) wv[j] = _mm512_loadu_si512(w + j * pstride);       \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                                   \
                uint32_t xp;                                                                                        \
                memcpy(&xp, x + i * ldx + k, sizeof xp);                                                            \
                const __m512i xb = _mm512_set1_epi32((int)xp);                                                      \
                _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++)                                                \
                    acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)xb, (__m512bh)wv[j]);                         \
            }                                                                                                       \
        }                                                                                                           \
        const int esz = ybf ? 2 : 4;                                                                                \
        _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++) {                                                      \
            const int left = ncols - j * NR;                                                                        \
            if (left <= 0) break;                                                                                   \
            const __mmask16 m = (__mmask16)(left >= NR ? 0xffffu : (1u << left) - 1u);                              \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++)                                                     \
                store16_f32_or_bf16((char *)y + (i * ldy + j * NR) * esz, ybf, acc[i][j], m);                       \
        }                                                                                                           \
    }
#define DEF_PAIRS_ROW(R) DEF_PAIRS_TILE(R, 1) DEF_PAIRS_TILE(R, 2) DEF_PAIRS_TILE(R, 3) DEF_PAIRS_TILE(R, 4)
DEF_PAIRS_ROW(1) DEF_PAIRS_ROW(2) DEF_PAIRS_ROW(3) DEF_PAIRS_ROW(4) DEF_PAIRS_ROW(5) DEF_PAIRS_ROW(6)
#define PAIRS_ROW(R) {0, pairs_tile_##R##_1, pairs_tile_##R##_2, pairs_tile_##R##_3, pairs_tile_##R##_4}
static const pairs_tile_fn PAIRS_TILES[MR + 1][NPM + 1] = {
    [1] = PAIRS_ROW(1), [2] = PAIRS_ROW(2), [3] = PAIRS_ROW(3), [4] = PAIRS_ROW(4), [5] = PAIRS_ROW(5), [6] = PAIRS_ROW(6),
};

/* rows [m0, m1) x panels [p0, p1) of y: panels NPM at a time, every row tile over them (rows cut
 * into balanced tiles of at most MR: 13 rows are 5 + 4 + 4, not 6 + 6 + 1) */
static void pairs_range(const uint16_t *x, int64_t ldx, const uint16_t *wp, const float *bias, void *y, int64_t ldy,
                        int ybf, int64_t N, int64_t K, int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
    const int64_t pstride = K * NR, rows = m1 - m0, tiles = (rows + MR - 1) / MR;
    const int esz = ybf ? 2 : 4;
    for (int64_t p = p0; p < p1; p += NPM) {
        const int np = (int)(p1 - p < NPM ? p1 - p : NPM);
        const int64_t c0 = p * NR;
        const int ncols = (int)(N - c0 < np * NR ? N - c0 : np * NR);
        int64_t r = m0;
        for (int64_t t = 0; t < tiles; t++) {
            const int mr = (int)(rows / tiles + (t < rows % tiles));
            PAIRS_TILES[mr][np](x + r * ldx, ldx, wp + p * pstride, pstride, K, bias ? bias + c0 : NULL,
                                (char *)y + (r * ldy + c0) * esz, ldy, ybf, ncols);
            r += mr;
        }
    }
}
#endif

/* 1 where this build has the kernel (its CPU has AVX512_BF16), else 0 */
int qw_gemm_bf16_pairs_built(void) { return QW_PAIRS_DOT; }

/*
 * qw_gemm_bf16_amx's arguments (csrc/gemm_amx.c), the same layout and checks: x bf16, K a multiple
 * of 32, mc/group/kc ignored. Returns 0; -1 for invalid sizes or fp32 x; -2 when scratch memory
 * cannot be allocated; -3 where this build has no AVX512_BF16.
 */
int qw_gemm_bf16_pairs(const void *x, int64_t ldx, int x_bf16, const uint16_t *wp, const void *bias, int bias_bf16,
                       void *y, int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads, int64_t mc,
                       int64_t group, int64_t kc) {
    (void)mc, (void)group, (void)kc;
    if (M < 0 || N < 0 || K < 0 || K % 32 || !x_bf16 || (M > 0 && (ldx < K || ldy < N))) return -1;
#if QW_PAIRS_DOT
    if (M == 0 || N == 0) return 0;
    const int64_t P = (N + NR - 1) / NR;
    float *bp = NULL; /* the bias, zero-padded to whole panels: each sum starts from it */
    if (bias) {
        bp = calloc((size_t)(P * NR), sizeof(float));
        if (!bp) return -2;
        for (int64_t n = 0; n < N; n++) bp[n] = bias_bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
    }
    const int64_t row_tiles = (M + MR - 1) / MR;
    int nt = num_threads < 1 ? 1 : num_threads;
    if ((double)M * (double)N * (double)K < 32768.0) nt = 1; /* fork/join would cost more */
    int tn = nt, tm = 1; /* threads over panels, over rows */
    if (P < nt) {
        tn = (int)P;
        tm = nt / tn;
        if (tm > row_tiles) tm = (int)row_tiles;
    }
    nt = tn * tm;
    /* every team-th share per thread: all nt shares are computed whatever team size OpenMP gives */
#pragma omp parallel num_threads(nt) if (nt > 1)
    for (int t = omp_get_thread_num(), team = omp_get_num_threads(); t < nt; t += team) {
        const int it = t % tn, jt = t / tn;
        const int64_t m0 = row_tiles * jt / tm * MR, m1e = row_tiles * (jt + 1) / tm * MR;
        pairs_range((const uint16_t *)x, ldx, wp, bp, y, ldy, y_bf16 != 0, N, K, m0, m1e < M ? m1e : M, P * it / tn,
                    P * (it + 1) / tn);
    }
    free(bp);
    return 0;
#else
    (void)x, (void)wp, (void)bias, (void)bias_bf16, (void)y, (void)y_bf16, (void)num_threads;
    return -3;
#endif
}
