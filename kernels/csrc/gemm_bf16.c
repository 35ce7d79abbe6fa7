/*
 * GEMM with bf16 WEIGHTS for the CPU bf16 mode: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W packed
 * once at load into gemm_f32.c's panel layout, but in bf16 (half the bytes):
 *
 *   wp [P = ceil(N / 16)][K][16] uint16 (bf16 bits)   panel p, row k holds W[p * 16 + c, k]
 *                                                      (columns past N are zero)
 *
 * Small batches (decode) are bound by reading every weight once per call; bf16 weights halve that
 * stream, and on CPUs without AVX512_BF16/AMX (AVX2 only) oneDNN's bf16 GEMM is emulated and slow.
 * Here the weights are widened to fp32 in registers and the arithmetic is the fp32 kernel's: fp32
 * FMAs, fp32 accumulators. Products of bf16 values are exact in fp32, so with bf16-valued x the
 * result is the fp32 GEMM of the widened operands up to the summation order.
 *
 * x: fp32, or bf16 (widened once per call into an fp32 copy, so the tiles broadcast fp32 as the
 * fp32 kernel does; an M x K copy is small next to the N x K weights). bias: fp32, bf16 or NULL
 * (copied into a zero-padded fp32 row). y: fp32, or bf16 rounded to nearest even from the fp32
 * accumulator (NaN -> 0x7fc0, as torch's scalar float -> bfloat16 conversion); with more than one K block
 * a bf16 y is accumulated in an fp32 scratch first and rounded once at the end.
 *
 * Widening (AVX2): a panel row is 16 bf16 = one 32-byte load. Seen as 8 32-bit lanes, lane j holds
 * column 2j in its low half and 2j+1 in its high half, so `lane << 16` is column 2j as a float and
 * `lane & 0xffff0000` column 2j+1: two 1-uop integer ops per 16 weights, no shuffles (zero-
 * extending each half with vpmovzxwd and then shifting takes 4 ops, two of them shuffles). The
 * accumulators therefore hold even and odd columns; tiles deinterleave bias/y when they start and
 * interleave once when they store, outside the k loop. Each column still sums k = 0..K-1 in order.
 *
 * Tiling, blocking, prefetching and threads follow gemm_f32.c (see there for why): AVX2+FMA main
 * tile 6 x 16 with 1-3 row tiles widened over 2-4 panels; generic C main tile 4 x 16; OpenMP over
 * panel ranges (and rows when panels are too few), each team thread taking every team-th share so
 * a smaller team than asked still computes everything; weight groups of ~1 MB, x blocks of ~128 kB,
 * K blocks of <= 2048; the next step's weights prefetched during a step (half the lines per k of
 * fp32).
 *
 * Dot-product kernel (AVX512_BF16, the "avx512" build on CPUs that have it: Zen 4, Sapphire Rapids
 * and later): for bf16 x only, VDPBF16PS does 2 multiply-adds per fp32 lane, twice the FMA path's
 * arithmetic per instruction, which is what a prefill chunk is bound by. The panel layout is the
 * same; two panel rows (k, k + 1) are interleaved into bf16 pairs in a register (one VPERMT2W per
 * 16 columns x 2 k, shared by the tile's rows), each row's (x[k], x[k + 1]) pair is broadcast as
 * one 32-bit value, and an odd K's last row pairs with zeros. Each column then sums pairs
 * (x[k + 1] w[k + 1] first, then x[k] w[k], as the instruction defines; products of bf16 values are
 * exact in fp32), so results differ from the FMA path's in rounding only; the instruction treats
 * bf16 denormals as zero. The pairs are (k, k + 1) for even k counted from 0 over the whole of K:
 * K blocks start at even k (kstep 2), as a pair split over two blocks would be summed in another
 * order (x[k] w[k] first) and a row's bits would then depend on the blocking knobs. Tiles 6 x 16
 * (1-3 rows over 2-4 panels, as the AVX2 ones) with 16-column zmm accumulators (no even/odd split). fp32 x keeps the FMA path (its values are used unrounded).
 * qw_gemm_bf16_isa() says 2 where the dot-product kernel is built in.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QW_BF_ISA 1
#define MR_MAIN 6
#define NP_MAX 4
#else
#define QW_BF_ISA 0
#define MR_MAIN 4
#define NP_MAX 2
#endif

#if QW_BF_ISA == 1 && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(QW_GEMM_AVX512)
#define QW_BF_DOT 1
#else
#define QW_BF_DOT 0
#endif

#define NR 16 /* panel width in columns */
#define LINE 64

#if QW_BF_ISA > 0
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#endif
/* the tile's output lines, requested for writing when it starts (gemm_f32.c: PREFETCH_Y) */
#define PREFETCH_Y(MR, NP)                                                                                          \
    for (int i = 0; i < MR; i++)                                                                                    \
        for (int c = 0; c < NP * NR * esz; c += LINE) __builtin_prefetch((char *)y + (i * ldy) * esz + c, 1, 3);

static inline int panels_for_rows(int64_t rows) {
    if (rows >= MR_MAIN) return 1;
#if QW_BF_ISA == 1
    if (rows == 1) return 4;
    if (rows <= 3) return 2;
    return 1;
#else
    return rows == 1 ? 2 : 1;
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN -> quiet NaN like torch */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if QW_BF_ISA == 1
/* 16 consecutive floats -> (even columns, odd columns), in the accumulators' lane order */
static inline void deinterleave16(const float *p, __m256 *even, __m256 *odd) {
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    const __m256 lo = _mm256_permute2f128_ps(a, b, 0x20), hi = _mm256_permute2f128_ps(a, b, 0x31); /* 0-3 8-11 | 4-7 12-15 */
    *even = _mm256_shuffle_ps(lo, hi, 0x88); /* 0 2 4 6 | 8 10 12 14 */
    *odd = _mm256_shuffle_ps(lo, hi, 0xdd);  /* 1 3 5 7 | 9 11 13 15 */
}

/* (even, odd) -> columns 0-7 and 8-15 */
static inline void interleave16(__m256 even, __m256 odd, __m256 *a, __m256 *b) {
    const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd); /* 0-3 8-11 | 4-7 12-15 */
    *a = _mm256_permute2f128_ps(lo, hi, 0x20);
    *b = _mm256_permute2f128_ps(lo, hi, 0x31);
}

static inline __m256i bf16_round8(__m256 v) { /* 8 floats -> 8 bf16 in the low halves of 32-bit lanes */
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

static inline void store_bf16x16(uint16_t *p, __m256 a, __m256 b) {
    const __m256i packed = _mm256_packus_epi32(bf16_round8(a), bf16_round8(b)); /* a0-3 b0-3 | a4-7 b4-7 */
    _mm256_storeu_si256((__m256i *)p, _mm256_permute4x64_epi64(packed, 0xd8));
}

/* Whether a tile's x broadcasts are reloaded for each panel instead of kept in registers across
 * the panels: accumulators (2 per row and panel) + one broadcast per row + the panel's two weight
 * vectors + the mask would not fit in the 16 ymm registers (3 x 32: 12 + 3 + 3), and gcc then
 * spilled an accumulator, a store-load chain on every k (3 rows took 1.4x as long as 4). The empty
 * asm hides that xj == x so the loads cannot be merged; a broadcast from memory is one load. */
#define BCAST_PER_PANEL(MR, NP) (MR * 2 * NP + MR + 3 > 16)

/*
 * One tile: rows MR of x (fp32, ldx apart), NP adjacent panels (pstride elements apart) from w,
 * k = 0..K-1; writes ncols (<= 16 * NP) columns of y (ldy elements apart, fp32 or bf16 by ybf).
 * bias: 16 * NP fp32 (zero-padded) or NULL; accum: continue from an fp32 y (later K blocks).
 * acc[i][2j] holds panel j's even columns, acc[i][2j + 1] its odd ones.
 */
#define TILE_BODY(MR, NP)                                                                                           \
    const int esz = ybf ? 2 : 4;                                                                                    \
    __m256 acc[MR][2 * NP];                                                                                         \
    if (accum) {                                                                                                    \
        _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                                      \
            const float *yi = (const float *)y + i * ldy;                                                           \
            float tmp[NP * NR];                                                                                     \
            if (ncols < NP * NR) {                                                                                  \
                memset(tmp, 0, sizeof tmp);                                                                         \
                memcpy(tmp, yi, (size_t)ncols * sizeof(float));                                                     \
                yi = tmp;                                                                                           \
            }                                                                                                       \
            _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++)                                                    \
                deinterleave16(yi + j * NR, &acc[i][2 * j], &acc[i][2 * j + 1]);                                    \
        }                                                                                                           \
    } else {                                                                                                        \
        _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++) {                                                      \
            __m256 e = _mm256_setzero_ps(), o = _mm256_setzero_ps();                                                \
            if (bias) deinterleave16(bias + j * NR, &e, &o);                                                        \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) acc[i][2 * j] = e, acc[i][2 * j + 1] = o;          \
        }                                                                                                           \
        PREFETCH_Y(MR, NP);                                                                                         \
    }                                                                                                               \
    const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);                                                    \
    const uint16_t *wk = w;                                                                                         \
    int64_t pfpos = 0;                                                                                              \
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; k++, wk += NR, pfpos += pfrate) {                            \
        _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++)                                                        \
            PREFETCH(pf + j * pstride * 2 + (pfpos >> 16) * LINE);                                                  \
        _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++) { /* panel by panel: 2 weight vectors live */         \
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(wk + j * pstride));                            \
            const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));                                    \
            const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(raw, hi_mask));                                 \
            const float *xj = x;                                                                                    \
            if (NP > 1 && BCAST_PER_PANEL(MR, NP)) __asm__ volatile("" : "+r"(xj));                                 \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                                  \
                const __m256 a = _mm256_broadcast_ss(xj + i * ldx + k);                                             \
                acc[i][2 * j] = _mm256_fmadd_ps(a, even, acc[i][2 * j]);                                            \
                acc[i][2 * j + 1] = _mm256_fmadd_ps(a, odd, acc[i][2 * j + 1]);                                     \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                                          \
        float ftmp[NP * NR];                                                                                        \
        uint16_t htmp[NP * NR];                                                                                     \
        const int full = ncols == NP * NR;                                                                          \
        float *yf = full ? (float *)y + i * ldy : ftmp;                                                             \
        uint16_t *yh = full ? (uint16_t *)y + i * ldy : htmp;                                                       \
        _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++) {                                                      \
            __m256 lo, hi;                                                                                          \
            interleave16(acc[i][2 * j], acc[i][2 * j + 1], &lo, &hi);                                               \
            if (ybf)                                                                                                \
                store_bf16x16(yh + j * NR, lo, hi);                                                                 \
            else                                                                                                    \
                _mm256_storeu_ps(yf + j * NR, lo), _mm256_storeu_ps(yf + j * NR + 8, hi);                           \
        }                                                                                                           \
        if (!full) {                                                                                                \
            if (ybf)                                                                                                \
                memcpy((uint16_t *)y + i * ldy, htmp, (size_t)ncols * 2);                                           \
            else                                                                                                    \
                memcpy((float *)y + i * ldy, ftmp, (size_t)ncols * 4);                                              \
        }                                                                                                           \
    }
#else
/* plain C: widen one panel row at a time, multiply-add over the rows (the compiler vectorises) */
#define TILE_BODY(MR, NP)                                                                                           \
    const int esz = ybf ? 2 : 4;                                                                                    \
    float acc[MR][NP * NR];                                                                                         \
    if (!accum) PREFETCH_Y(MR, NP);                                                                                 \
    for (int i = 0; i < MR; i++)                                                                                    \
        for (int c = 0; c < NP * NR; c++)                                                                           \
            acc[i][c] = accum ? (c < ncols ? ((const float *)y)[i * ldy + c] : 0.0f) : bias ? bias[c] : 0.0f;       \
    for (int64_t k = 0, pfpos = 0; k < K; k++, pfpos += pfrate) {                                                   \
        for (int p = 0; p < NP; p++) {                                                                              \
            PREFETCH(pf + p * pstride * 2 + (pfpos >> 16) * LINE);                                                  \
            const uint16_t *restrict wk = w + p * pstride + k * NR;                                                 \
            float wf[NR];                                                                                           \
            for (int c = 0; c < NR; c++) wf[c] = bf16_to_f32(wk[c]);                                                \
            for (int i = 0; i < MR; i++) {                                                                          \
                const float a = x[i * ldx + k];                                                                     \
                for (int c = 0; c < NR; c++) acc[i][p * NR + c] += a * wf[c];                                       \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
    for (int i = 0; i < MR; i++) {                                                                                  \
        if (ybf)                                                                                                    \
            for (int c = 0; c < ncols; c++) ((uint16_t *)y)[i * ldy + c] = f32_to_bf16(acc[i][c]);                  \
        else                                                                                                        \
            memcpy((float *)y + i * ldy, acc[i], (size_t)ncols * sizeof(float));                                    \
    }
#endif

/* x: fp32 for the FMA tiles, bf16 for the dot-product ones */
typedef void (*tile_fn)(const void *, int64_t, const uint16_t *, int64_t, int64_t, const float *, void *, int64_t,
                        int, int, int, const char *, int64_t);

#define DEF_TILE(MR, NP)                                                                                            \
    static void tile_##MR##_##NP(const void *restrict xv, int64_t ldx, const uint16_t *restrict w, int64_t pstride, \
                                 int64_t K, const float *restrict bias, void *restrict y, int64_t ldy, int ybf,     \
                                 int ncols, int accum, const char *pf, int64_t pfrate) {                            \
        const float *restrict x = (const float *)xv;                                                                \
        TILE_BODY(MR, NP)                                                                                           \
    }

#if QW_BF_ISA == 1
DEF_TILE(1, 1) DEF_TILE(1, 2) DEF_TILE(1, 3) DEF_TILE(1, 4)
DEF_TILE(2, 1) DEF_TILE(2, 2) DEF_TILE(3, 1) DEF_TILE(3, 2)
DEF_TILE(4, 1) DEF_TILE(5, 1) DEF_TILE(6, 1)
static const tile_fn TILES[MR_MAIN + 1][NP_MAX + 1] = {
    [1] = {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4}, [2] = {0, tile_2_1, tile_2_2}, [3] = {0, tile_3_1, tile_3_2},
    [4] = {0, tile_4_1}, [5] = {0, tile_5_1}, [6] = {0, tile_6_1},
};
#else
DEF_TILE(1, 1) DEF_TILE(1, 2) DEF_TILE(2, 1) DEF_TILE(3, 1) DEF_TILE(4, 1)
static const tile_fn TILES[MR_MAIN + 1][NP_MAX + 1] = {
    [1] = {0, tile_1_1, tile_1_2}, [2] = {0, tile_2_1}, [3] = {0, tile_3_1}, [4] = {0, tile_4_1},
};
#endif

#if QW_BF_DOT
/* dot-product primitives (the test suite swaps this block for plain C to run the tiling anywhere) */
typedef __m512 dvec;   /* 16 fp32 accumulators: one panel's columns */
typedef __m512i dpair; /* 16 bf16 pairs */
static inline dvec dvec_zero(void) { return _mm512_setzero_ps(); }
static inline dvec dvec_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void dvec_store(float *p, dvec v) { _mm512_storeu_ps(p, v); }
/* panel rows k (r0) and k + 1 (r1; NULL: zeros) as pairs (r0[c], r1[c]) */
static inline dpair w_pairs(const uint16_t *r0, const uint16_t *r1) {
    const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                         36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r0));
    const __m512i b = r1 ? _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r1)) : _mm512_setzero_si512();
    return _mm512_permutex2var_epi16(a, idx, b);
}
static inline dpair x_pair(uint32_t bits) { return _mm512_set1_epi32((int)bits); }
static inline dvec dot2(dvec acc, dpair x, dpair w) { return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w); }
/* end of the dot-product primitives */

#define DOT_BODY(MR, NP)                                                                                            \
    const int esz = ybf ? 2 : 4;                                                                                    \
    dvec acc[MR][NP];                                                                                               \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                                          \
        float tmp[NP * NR];                                                                                         \
        const float *src = accum ? (const float *)y + i * ldy : bias;                                               \
        if (accum && ncols < NP * NR) {                                                                             \
            memset(tmp, 0, sizeof tmp);                                                                             \
            memcpy(tmp, src, (size_t)ncols * sizeof(float));                                                        \
            src = tmp;                                                                                              \
        }                                                                                                           \
        _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++) acc[i][j] = src ? dvec_load(src + j * NR) : dvec_zero(); \
    }                                                                                                               \
    if (!accum) PREFETCH_Y(MR, NP);                                                                                 \
    const uint16_t *wk = w;                                                                                         \
    int64_t k = 0, pfpos = 0;                                                                                       \
    for (; k + 1 < K; k += 2, wk += 2 * NR) {                                                                       \
        _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++) {                                                      \
            PREFETCH(pf + j * pstride * 2 + (pfpos >> 16) * LINE);                                                  \
            PREFETCH(pf + j * pstride * 2 + ((pfpos + pfrate) >> 16) * LINE);                                       \
        }                                                                                                           \
        pfpos += 2 * pfrate;                                                                                        \
        _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++) {                                                      \
            const dpair wp2 = w_pairs(wk + j * pstride, wk + j * pstride + NR);                                     \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                                  \
                uint32_t xp;                                                                                        \
                memcpy(&xp, x + i * ldx + k, sizeof xp);                                                            \
                acc[i][j] = dot2(acc[i][j], x_pair(xp), wp2);                                                       \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
    if (k < K) { /* odd K: the last row pairs with zeros */                                                         \
        _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++) {                                                      \
            const dpair wp2 = w_pairs(wk + j * pstride, NULL);                                                      \
            _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++)                                                    \
                acc[i][j] = dot2(acc[i][j], x_pair(x[i * ldx + k]), wp2);                                           \
        }                                                                                                           \
    }                                                                                                               \
    _Pragma("GCC unroll 8") for (int i = 0; i < MR; i++) {                                                          \
        float ftmp[NP * NR];                                                                                        \
        const int direct = !ybf && ncols == NP * NR;                                                                \
        float *yf = direct ? (float *)y + i * ldy : ftmp;                                                           \
        _Pragma("GCC unroll 8") for (int j = 0; j < NP; j++) dvec_store(yf + j * NR, acc[i][j]);                    \
        if (ybf)                                                                                                    \
            for (int c = 0; c < ncols; c++) ((uint16_t *)y)[i * ldy + c] = f32_to_bf16(ftmp[c]);                    \
        else if (!direct)                                                                                           \
            memcpy((float *)y + i * ldy, ftmp, (size_t)ncols * 4);                                                  \
    }

#define DEF_DOT_TILE(MR, NP)                                                                                        \
    static void dot_tile_##MR##_##NP(const void *restrict xv, int64_t ldx, const uint16_t *restrict w,              \
                                     int64_t pstride, int64_t K, const float *restrict bias, void *restrict y,      \
                                     int64_t ldy, int ybf, int ncols, int accum, const char *pf, int64_t pfrate) {  \
        const uint16_t *restrict x = (const uint16_t *)xv;                                                          \
        DOT_BODY(MR, NP)                                                                                            \
    }
DEF_DOT_TILE(1, 1) DEF_DOT_TILE(1, 2) DEF_DOT_TILE(1, 3) DEF_DOT_TILE(1, 4)
DEF_DOT_TILE(2, 1) DEF_DOT_TILE(2, 2) DEF_DOT_TILE(3, 1) DEF_DOT_TILE(3, 2)
DEF_DOT_TILE(4, 1) DEF_DOT_TILE(5, 1) DEF_DOT_TILE(6, 1)
static const tile_fn DOT_TILES[MR_MAIN + 1][NP_MAX + 1] = {
    [1] = {0, dot_tile_1_1, dot_tile_1_2, dot_tile_1_3, dot_tile_1_4}, [2] = {0, dot_tile_2_1, dot_tile_2_2},
    [3] = {0, dot_tile_3_1, dot_tile_3_2}, [4] = {0, dot_tile_4_1}, [5] = {0, dot_tile_5_1}, [6] = {0, dot_tile_6_1},
};
#endif

/* Start of K block kb of nk over K, in whole steps of kstep k (the last block ends at K): balanced,
 * none empty when nk <= ceil(K / kstep) */
static inline int64_t k_bound(int64_t K, int64_t kstep, int64_t nk, int64_t kb) {
    const int64_t k = (K + kstep - 1) / kstep * kb / nk * kstep;
    return k < K ? k : K;
}

/* Rows m0..m1 x panels p0..p1 of y (one thread's share) with the table's tiles; x fp32 or bf16 as
 * the table's tiles take it (xsz bytes an element, ldx elements a row), bias padded fp32 or NULL, y fp32
 * or bf16 (ybf, ldy elements), nk balanced K blocks starting at multiples of kstep (k_bound). */
static void gemm_range(const tile_fn (*table)[NP_MAX + 1], const void *x, int xsz, int64_t ldx, const uint16_t *wp,
                       const float *bias, void *y, int64_t ldy, int ybf, int64_t N, int64_t K, int64_t kstep, int64_t nk,
                       int64_t m0, int64_t m1, int64_t p0, int64_t p1, int64_t mc, int64_t group) {
    const int64_t M = m1 - m0;
    if (M <= 0 || p1 <= p0) return;
    const int64_t pstride = K * NR, esz = ybf ? 2 : 4;
    const int np = panels_for_rows(M < MR_MAIN ? M : MR_MAIN);
    { /* balanced x blocks, whole main tiles */
        const int64_t nblocks = (M + mc - 1) / mc;
        mc = (M + nblocks - 1) / nblocks;
        mc = (mc + MR_MAIN - 1) / MR_MAIN * MR_MAIN;
    }
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
        const int64_t g1 = g0 + group < p1 ? g0 + group : p1;
        for (int64_t b0 = m0; b0 < m1; b0 += mc) {
            const int64_t b1 = b0 + mc < m1 ? b0 + mc : m1;
            const int64_t rows = b1 - b0;
            const int64_t tiles = (rows + MR_MAIN - 1) / MR_MAIN;
            for (int64_t kb = 0; kb < nk; kb++) {
                const int64_t k0 = k_bound(K, kstep, nk, kb), k1 = k_bound(K, kstep, nk, kb + 1), kcur = k1 - k0;
                for (int64_t p = g0; p < g1; p += np) {
                    const int npp = (int)(g1 - p < np ? g1 - p : np);
                    const int64_t c0 = p * NR;
                    const int ncols = (int)(N - c0 < npp * NR ? N - c0 : npp * NR);
                    /* the next step's weights (as gemm_f32.c), spread over this step's row tiles.
                     * Unlike fp32, the 2-3 row tiles (2 panels) gain from it too (all 120 layer
                     * projections of the test model, one thread: 2 rows 12.5 -> 10.9 ms, 3 rows
                     * 13.6 -> 11.3 ms); the 1-row tile (4 panels) is even either way and is left
                     * to the hardware prefetcher */
                    int64_t next_p = p, next_k0 = k0, next_k1 = k1;
                    if (p + np < g1) next_p = p + np;
                    else if (kb + 1 < nk) next_p = g0, next_k0 = k1, next_k1 = k_bound(K, kstep, nk, kb + 2);
                    else if (b1 < m1) next_p = g0, next_k0 = 0, next_k1 = k_bound(K, kstep, nk, 1);
                    else if (g1 < p1) next_p = g1, next_k0 = 0, next_k1 = k_bound(K, kstep, nk, 1);
                    const int pf_on = tiles > 1 || np <= 2;
                    const int64_t lines = pf_on ? (next_k1 - next_k0 + 1) / 2 : 0; /* 2 panel rows per 64-byte line */
                    const char *pf = (const char *)(wp + next_p * pstride + next_k0 * NR);
                    int64_t r = b0;
                    for (int64_t t = 0; t < tiles; t++) {
                        const int mr = (int)(rows / tiles + (t < rows % tiles));
                        const int64_t lo = lines * t / tiles, hi = lines * (t + 1) / tiles;
                        const int64_t rate = kcur > 0 ? ((hi - lo) << 16) / kcur : 0; /* lines per k, 16.16 */
                        table[mr][npp]((const char *)x + (r * ldx + k0) * xsz, ldx, wp + p * pstride + k0 * NR, pstride, kcur,
                                       bias ? bias + c0 : NULL, (char *)y + (r * ldy + c0) * esz, ldy, ybf, ncols,
                                       kb > 0, pf + lo * LINE, rate);
                        r += mr;
                    }
                }
            }
        }
    }
}

#define QW_K_BLOCK 2048
#define QW_X_BLOCK_BYTES (128 * 1024)
#define QW_W_GROUP_BYTES (1024 * 1024)

/*
 * y[M, N] (rows ldy elements apart; bf16 when y_bf16, else fp32) = x[M, K] (rows ldx elements
 * apart; bf16 when x_bf16, else fp32) @ W^T (+ bias[N], bf16 when bias_bf16, else fp32; NULL for
 * none), W packed bf16 as above. mc/group/kc: the cache-blocking knobs of qw_gemm_f32 (0 =
 * defaults). Returns 0, -1 for invalid sizes, -2 when scratch memory cannot be allocated.
 */
int qw_gemm_bf16(const void *x, int64_t ldx, int x_bf16, const uint16_t *wp, const void *bias, int bias_bf16, void *y,
                 int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads, int64_t mc, int64_t group,
                 int64_t kc) {
    if (M < 0 || N < 0 || K < 0 || (M > 0 && (ldx < K || ldy < N))) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t npanels = (N + NR - 1) / NR;
    /* the tiles read x as fp32 (the FMA path: bf16 x widened first) or as bf16 (the dot path) */
    const int xsz = QW_BF_DOT && x_bf16 ? 2 : 4;
    /* K blocks in whole steps: the dot path sums k in pairs (2j, 2j + 1), and a block starting at an
     * odd k would split a pair, summing its two products in the other order (the row's bits would
     * then depend on the K blocking); the FMA path sums k one at a time */
    const int64_t kstep = xsz == 2 ? 2 : 1, ksteps = (K + kstep - 1) / kstep;
    if (kc <= 0) {
        const int64_t n = (K + QW_K_BLOCK - 1) / QW_K_BLOCK;
        kc = n > 0 ? (K + n - 1) / n : 1;
    }
    if (kc > K) kc = K > 0 ? K : 1;
    kc = (kc + kstep - 1) / kstep * kstep;                       /* whole steps */
    const int64_t nk = K > 0 ? (ksteps + kc / kstep - 1) / (kc / kstep) : 1; /* K = 0: one empty block, the bias */
    if (mc <= 0) {
        mc = QW_X_BLOCK_BYTES / (kc * xsz);
        mc = mc < MR_MAIN ? MR_MAIN : mc / MR_MAIN * MR_MAIN;
    }
    if (group <= 0) {
        group = QW_W_GROUP_BYTES / (K > 0 ? K * NR * 2 : 2);
        if (group < 1) group = 1;
    }
    const int np = panels_for_rows(M < MR_MAIN ? M : MR_MAIN);
    if (group % np) group += np - group % np;

    /* scratch: x widened to fp32 (the FMA path), bias padded to whole panels, an fp32 y for bf16
     * output over several K blocks (a partial sum must not be rounded) */
    float *xf = NULL, *bf = NULL, *yt = NULL;
    const void *xs = x;
    int64_t ldxs = ldx;
    int rc = 0;
    const tile_fn(*table)[NP_MAX + 1] = TILES;
#if QW_BF_DOT
    if (x_bf16) table = DOT_TILES; /* bf16 x as it is */
#endif
    if (x_bf16 && xsz == 4 && K > 0) {
        xf = malloc((size_t)(M * K) * sizeof(float));
        if (!xf) { rc = -2; goto done; }
        for (int64_t i = 0; i < M; i++)
            for (int64_t k = 0; k < K; k++) xf[i * K + k] = bf16_to_f32(((const uint16_t *)x)[i * ldx + k]);
        xs = xf, ldxs = K;
    }
    if (bias) {
        bf = calloc((size_t)(npanels * NR), sizeof(float));
        if (!bf) { rc = -2; goto done; }
        for (int64_t n = 0; n < N; n++) bf[n] = bias_bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
    }
    void *yk = y;
    int64_t ldyk = ldy;
    int ybf = y_bf16 != 0;
    if (ybf && nk > 1) {
        yt = malloc((size_t)(M * N) * sizeof(float));
        if (!yt) { rc = -2; goto done; }
        yk = yt, ldyk = N, ybf = 0;
    }

    const int64_t units = (npanels + np - 1) / np;
    int nt = num_threads < 1 ? 1 : num_threads;
    if ((double)M * (double)N * (double)K < 32768.0) nt = 1; /* fork/join would cost more */
    int tn = nt, tm = 1;
    if (units < nt) {
        tn = (int)units;
        tm = nt / tn;
        const int64_t row_tiles = (M + MR_MAIN - 1) / MR_MAIN;
        if (tm > row_tiles) tm = (int)row_tiles;
    }
    nt = tn * tm;
    /* every team-th share per thread: all nt shares are computed whatever team size OpenMP gives */
#pragma omp parallel num_threads(nt) if (nt > 1)
    for (int t = omp_get_thread_num(), team = omp_get_num_threads(); t < nt; t += team) {
        const int it = t % tn, jt = t / tn;
        const int64_t p0 = units * it / tn * np, p1e = units * (it + 1) / tn * np;
        const int64_t p1 = p1e < npanels ? p1e : npanels;
        int64_t m0 = 0, m1 = M;
        if (tm > 1) {
            const int64_t row_tiles = (M + MR_MAIN - 1) / MR_MAIN;
            m0 = row_tiles * jt / tm * MR_MAIN;
            m1 = row_tiles * (jt + 1) / tm * MR_MAIN;
            if (m1 > M) m1 = M;
        }
        gemm_range(table, xs, xsz, ldxs, wp, bf, yk, ldyk, ybf, N, K, kstep, nk, m0, m1, p0, p1, mc, group);
    }
    if (yt)
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = 0; n < N; n++) ((uint16_t *)y)[i * ldy + n] = f32_to_bf16(yt[i * N + n]);
done:
    free(xf);
    free(bf);
    free(yt);
    return rc;
}

/* The build's kernel: 2 = AVX512_BF16 dot products for bf16 x (AVX2+FMA for fp32 x), 1 = AVX2+FMA,
 * 0 = generic C. */
int qw_gemm_bf16_isa(void) { return QW_BF_DOT ? 2 : QW_BF_ISA; }
