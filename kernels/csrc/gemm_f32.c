/*
 * fp32 GEMM for the CPU engine's projections: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), with W
 * packed once at load into panels of 16 output columns:
 *
 *   wp [P = ceil(N / 16)][K][16]     panel p, row k holds W[p * 16 + c, k] for c = 0..15
 *                                     (columns past N are zero)
 *
 * so a micro-kernel reads each panel as one contiguous stream, 64 bytes per k (kernels/gemm_cpu.py
 * packs it; the layout is the same for every ISA build). x rows are ldx floats apart, y rows ldy.
 *
 * Micro-kernels: an MR x (16 * NP) register tile over a K block (NP adjacent panels, x elements
 * broadcast, weight vectors loaded once per k and reused over the MR rows):
 *   AVX-512  main tile 12 x 32 (24 zmm accumulators), compiled with -DQW_GEMM_AVX512 (the
 *            "avx512" build passes it; without it an AVX-512 build compiles the AVX2 path). Its
 *            tiling is checked on any CPU by an emulated build (plain-C stand-ins for the five
 *            intrinsics, tests/kernels/test_gemm_cpu_attack.py); on an AVX-512 CPU the engine
 *            checks it against torch at start-up and times it against the avx2 build's kernel,
 *            keeping the faster (kernels/gemm_cpu.py choose_gemm_isa).
 *   AVX2+FMA main tile  6 x 16 (12 ymm accumulators, BLIS-Haswell-like)
 *   generic  main tile  4 x 16, plain C the compiler vectorises
 * The rows of one call are cut into row tiles of balanced size (13 rows: 5 + 4 + 4, never 6 + 6 + 1,
 * whose 1-row tile would be FMA-latency bound); with fewer rows than the main tile, the tile
 * widens over more panels instead (AVX2: 1 x 64, 2 x 32, 3 x 32) so that enough independent
 * accumulators hide the FMA latency.
 *
 * Threads (OpenMP, the count torch uses: libgomp is shared with torch) each take a contiguous
 * range of panels (and, when there are too few panels for every thread, a range of rows too),
 * without barriers. Within its range a thread walks groups of panels (~1 MB of weights, kept in
 * L3), per group blocks of MC rows of x (kept in L2), per x block K blocks of <= QW_K_BLOCK
 * (later K blocks continue from y; by default one block up to K = 2048, A/B runs at 288/308
 * showed no gain on this machine): every weight is read from memory once at any M, x once per
 * group from L3. The next
 * step's weights are prefetched while a step runs, and each tile's output lines at its start.
 *
 * kernels/cpu.py builds this file once per vector ISA ("avx512", "avx2" = -mno-avx512f,
 * "generic" = -mno-avx); the best path the flags allow is compiled.
 */
#include <stdint.h>
#include <string.h>

#include <omp.h>

#if defined(__AVX512F__) && defined(QW_GEMM_AVX512)
#include <immintrin.h>
#define QW_GEMM_ISA 2
#define VW 16   /* floats per vector */
#define MR_MAIN 12
#define NP_MAIN 2
#define NP_MAX 8
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QW_GEMM_ISA 1
#define VW 8
#define MR_MAIN 6
#define NP_MAIN 1
#define NP_MAX 4
#else
#define QW_GEMM_ISA 0
#define MR_MAIN 4
#define NP_MAIN 1
#define NP_MAX 2
#endif

#define NR 16 /* panel width in floats */
/* The tile's output lines, requested for writing when the tile starts (a K-step tile later
 * stores them): y of the LM head at 1024 rows is 200 MB, 4x its weights, and each store would
 * otherwise miss to memory at the end of the tile. */
#ifndef QW_GEMM_NO_PREFETCH_Y
#define PREFETCH_Y(MR, NP)                                                                                          \
    for (int i = 0; i < MR; i++)                                                                                    \
        for (int c = 0; c < NP * NR; c += 16) __builtin_prefetch(y + i * ldy + c, 1, 3);
#else
#define PREFETCH_Y(MR, NP)
#endif
#if defined(QW_GEMM_NO_PREFETCH) /* A/B experiments */
#define PREFETCH(p) ((void)(p))
#elif QW_GEMM_ISA > 0
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#else
#define PREFETCH(p) __builtin_prefetch((p), 0, 3)
#endif
#define VPP (NR / VW) /* vectors per panel row */

/* The panel count per kernel call for a tile of `rows` rows (rows < MR_MAIN: wider tiles). */
static inline int panels_for_rows(int64_t rows) {
    if (rows >= MR_MAIN) return NP_MAIN;
#if QW_GEMM_ISA == 2
    if (rows == 1) return 8;
    if (rows <= 3) return 4;
    return 2;
#elif QW_GEMM_ISA == 1
    if (rows == 1) return 4;
    if (rows <= 3) return 2;
    return 1;
#else
    return rows == 1 ? 2 : 1;
#endif
}

#if QW_GEMM_ISA == 2
typedef __m512 vec;
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_BCAST(p) _mm512_set1_ps(*(p))
#define V_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif QW_GEMM_ISA == 1
typedef __m256 vec;
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#endif

/*
 * Register budget of a tile's k loop (NREGS vector registers; the summation order of every output
 * column is the same either way, k ascending, so the results are too):
 *  - WEIGHTS_FIT: the NP * VPP weight vectors of one k, MR * NP * VPP accumulators and a broadcast
 *    fit (or MR = 1, where gcc takes each weight vector as the FMA's memory operand): load all of
 *    the k's weights, then broadcast each x row once.
 *  - else the k loop goes panel by panel (VPP weight vectors live at a time). AVX2 3 x 32 needed
 *    12 accumulators + 4 weights + 1 broadcast = 17 ymm, and gcc kept one accumulator on the stack
 *    (vfmadd213ps 288(%rsp) + a store on every k: a store-load chain through the FMA latency).
 *  - BCAST_PER_PANEL: panel by panel, the MR broadcasts would stay live across the panels (gcc
 *    merges the repeated loads of one x element) and still not fit (3 x 32: 12 + 3 + 2): the empty
 *    asm hides that each panel's xp == x, so each panel broadcasts x again (one load each).
 * Of the tiles instantiated below only AVX2's 3 x 32 leaves the first path (the other AVX2 tiles
 * and every AVX-512 one compile as before; gcc 12's k loops of the 1-6 row tiles then keep every
 * accumulator and weight vector in registers).
 */
#if QW_GEMM_ISA == 2
#define NREGS 32
#else
#define NREGS 16
#endif
#define WEIGHTS_FIT(MR, NP) ((MR) == 1 || (MR) * (NP) * VPP + (NP) * VPP + 1 <= NREGS)
#define BCAST_PER_PANEL(MR, NP) ((NP) > 1 && (MR) * (NP) * VPP + (MR) + VPP > NREGS)

/*
 * One tile (TILE_BODY): rows MR (1..MR_MAIN) of x from x (ldx apart), panels NP (adjacent, pstride floats
 * apart) from w, k = 0..K-1. Writes ncols (<= 16 * NP) columns of y (ldy apart); bias: 16 * NP
 * floats (zero-padded past N) or NULL. MR and NP are constants in every instantiation below, so
 * the loops unroll and the accumulators live in registers.
 */
#if QW_GEMM_ISA > 0
#define TILE_BODY(MR, NP)                                                                                           \
    vec acc[MR][NP * VPP];                                                                                          \
    if (accum && ncols == NP * NR) { /* a later K block: continue from y */                                        \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++)                                                       \
            _Pragma("GCC unroll 16") for (int j = 0; j < NP * VPP; j++) acc[i][j] = V_LOAD(y + i * ldy + j * VW);   \
    } else if (accum) {                                                                                             \
        float tmp[NP * NR] = {0};                                                                                   \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                     \
            memcpy(tmp, y + i * ldy, (size_t)ncols * sizeof(float));                                                \
            _Pragma("GCC unroll 16") for (int j = 0; j < NP * VPP; j++) acc[i][j] = V_LOAD(tmp + j * VW);           \
        }                                                                                                           \
    } else {                                                                                                        \
        _Pragma("GCC unroll 16") for (int j = 0; j < NP * VPP; j++) {                                               \
            const vec b0 = bias ? V_LOAD(bias + j * VW) : V_ZERO();                                                 \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) acc[i][j] = b0;                                   \
        }                                                                                                           \
        PREFETCH_Y(MR, NP);                                                                                         \
    }                                                                                                               \
    const float *wk = w;                                                                                            \
    int64_t pfpos = 0;                                                                                              \
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; k++, wk += NR, pfpos += pfrate) {                            \
        _Pragma("GCC unroll 16") for (int j = 0; j < NP; j++)                                                       \
            PREFETCH(pf + j * pstride + (pfpos >> 16) * NR);                                                        \
        if (WEIGHTS_FIT(MR, NP)) { /* every weight vector of this k loaded once, then row by row */                \
            vec b[NP * VPP];                                                                                        \
            _Pragma("GCC unroll 16") for (int j = 0; j < NP * VPP; j++)                                             \
                b[j] = V_LOAD(wk + (j / VPP) * pstride + (j % VPP) * VW);                                           \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                 \
                const vec a = V_BCAST(x + i * ldx + k);                                                             \
                _Pragma("GCC unroll 16") for (int j = 0; j < NP * VPP; j++) acc[i][j] = V_FMA(a, b[j], acc[i][j]);  \
            }                                                                                                       \
        } else { /* panel by panel: VPP weight vectors live; x re-broadcast per panel where needed */              \
            _Pragma("GCC unroll 16") for (int p = 0; p < NP; p++) {                                                 \
                vec b[VPP];                                                                                         \
                _Pragma("GCC unroll 16") for (int v = 0; v < VPP; v++) b[v] = V_LOAD(wk + p * pstride + v * VW);    \
                const float *xp = x;                                                                                \
                if (BCAST_PER_PANEL(MR, NP)) __asm__ volatile("" : "+r"(xp));                                       \
                _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                             \
                    const vec a = V_BCAST(xp + i * ldx + k);                                                        \
                    _Pragma("GCC unroll 16") for (int v = 0; v < VPP; v++)                                          \
                        acc[i][p * VPP + v] = V_FMA(a, b[v], acc[i][p * VPP + v]);                                  \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
    if (ncols == NP * NR) {                                                                                         \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++)                                                       \
            _Pragma("GCC unroll 16") for (int j = 0; j < NP * VPP; j++) V_STORE(y + i * ldy + j * VW, acc[i][j]);   \
    } else {                                                                                                        \
        float tmp[NP * NR];                                                                                         \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                     \
            _Pragma("GCC unroll 16") for (int j = 0; j < NP * VPP; j++) V_STORE(tmp + j * VW, acc[i][j]);           \
            memcpy(y + i * ldy, tmp, (size_t)ncols * sizeof(float));                                                \
        }                                                                                                           \
    }
#else
#define TILE_BODY(MR, NP)                                                                                           \
    float acc[MR][NP * NR];                                                                                         \
    PREFETCH_Y(MR, NP);                                                                                             \
    for (int i = 0; i < MR; i++)                                                                                    \
        for (int c = 0; c < NP * NR; c++)                                                                           \
            acc[i][c] = accum ? (c < ncols ? y[i * ldy + c] : 0.0f) : bias ? bias[c] : 0.0f;                        \
    for (int64_t k = 0, pfpos = 0; k < K; k++, pfpos += pfrate) {                                                   \
        PREFETCH(pf + (pfpos >> 16) * NR);                                                                          \
        for (int p = 0; p < NP; p++) {                                                                              \
            const float *restrict wk = w + p * pstride + k * NR;                                                    \
            for (int i = 0; i < MR; i++) {                                                                          \
                const float a = x[i * ldx + k];                                                                     \
                for (int c = 0; c < NR; c++) acc[i][p * NR + c] += a * wk[c];                                       \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
    for (int i = 0; i < MR; i++) memcpy(y + i * ldy, acc[i], (size_t)ncols * sizeof(float));
#endif

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, int64_t, const float *, float *, int64_t, int,
                        int, const float *, int64_t);

#define DEF_TILE(MR, NP)                                                                                            \
    static void tile_##MR##_##NP(const float *restrict x, int64_t ldx, const float *restrict w, int64_t pstride,   \
                                 int64_t K, const float *restrict bias, float *restrict y, int64_t ldy, int ncols,  \
                                 int accum, const float *pf, int64_t pfrate) {                                      \
        TILE_BODY(MR, NP)                                                                                           \
    }

/* The instantiations each ISA's dispatch uses: (rows, panels) with rows <= MR_MAIN and panels
 * <= panels_for_rows(rows) (tail steps take fewer panels). */
#if QW_GEMM_ISA == 2
DEF_TILE(1, 1) DEF_TILE(1, 2) DEF_TILE(1, 3) DEF_TILE(1, 4) DEF_TILE(1, 5) DEF_TILE(1, 6) DEF_TILE(1, 7) DEF_TILE(1, 8)
DEF_TILE(2, 1) DEF_TILE(2, 2) DEF_TILE(2, 3) DEF_TILE(2, 4)
DEF_TILE(3, 1) DEF_TILE(3, 2) DEF_TILE(3, 3) DEF_TILE(3, 4)
DEF_TILE(4, 1) DEF_TILE(4, 2) DEF_TILE(5, 1) DEF_TILE(5, 2) DEF_TILE(6, 1) DEF_TILE(6, 2)
DEF_TILE(7, 1) DEF_TILE(7, 2) DEF_TILE(8, 1) DEF_TILE(8, 2) DEF_TILE(9, 1) DEF_TILE(9, 2)
DEF_TILE(10, 1) DEF_TILE(10, 2) DEF_TILE(11, 1) DEF_TILE(11, 2) DEF_TILE(12, 1) DEF_TILE(12, 2)
static const tile_fn TILES[MR_MAIN + 1][NP_MAX + 1] = {
    [1] = {0, tile_1_1, tile_1_2, tile_1_3, tile_1_4, tile_1_5, tile_1_6, tile_1_7, tile_1_8},
    [2] = {0, tile_2_1, tile_2_2, tile_2_3, tile_2_4}, [3] = {0, tile_3_1, tile_3_2, tile_3_3, tile_3_4},
    [4] = {0, tile_4_1, tile_4_2}, [5] = {0, tile_5_1, tile_5_2}, [6] = {0, tile_6_1, tile_6_2},
    [7] = {0, tile_7_1, tile_7_2}, [8] = {0, tile_8_1, tile_8_2}, [9] = {0, tile_9_1, tile_9_2},
    [10] = {0, tile_10_1, tile_10_2}, [11] = {0, tile_11_1, tile_11_2}, [12] = {0, tile_12_1, tile_12_2},
};
#elif QW_GEMM_ISA == 1
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

/* Rows m0..m1 x panels p0..p1 of y (one thread's share). */
static void gemm_range(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy,
                       int64_t N, int64_t K, int64_t m0, int64_t m1, int64_t p0, int64_t p1, int64_t mc, int64_t group,
                       int64_t kc) {
    const int64_t M = m1 - m0;
    if (M <= 0 || p1 <= p0) return;
    const int64_t pstride = K * NR;
    const int np = panels_for_rows(M < MR_MAIN ? M : MR_MAIN);
    { /* balanced x blocks (1024 rows at mc 108: 10 blocks of 108 - 6 = 102.4, not 9 of 108 and one of 52) */
        const int64_t nblocks = (M + mc - 1) / mc;
        mc = (M + nblocks - 1) / nblocks;
        mc = (mc + MR_MAIN - 1) / MR_MAIN * MR_MAIN;
    }
    const int64_t nk = K > 0 ? (K + kc - 1) / kc : 1; /* K blocks (K = 0: one empty block, the bias) */
    for (int64_t g0 = p0; g0 < p1; g0 += group) {
        const int64_t g1 = g0 + group < p1 ? g0 + group : p1;
        for (int64_t b0 = m0; b0 < m1; b0 += mc) {
            const int64_t b1 = b0 + mc < m1 ? b0 + mc : m1;
            const int64_t rows = b1 - b0;
            const int64_t tiles = (rows + MR_MAIN - 1) / MR_MAIN;
            for (int64_t kb = 0; kb < nk; kb++) {
                const int64_t k0 = K * kb / nk, k1 = K * (kb + 1) / nk, kcur = k1 - k0;
                for (int64_t p = g0; p < g1; p += np) {
                    const int npp = (int)(g1 - p < np ? g1 - p : np);
                    const int64_t c0 = p * NR;
                    const int ncols = (int)(N - c0 < npp * NR ? N - c0 : npp * NR);
                    const float *bp = bias ? bias + c0 : NULL;
                    float bpad[NP_MAX * NR];
                    if (bias && ncols < npp * NR) { /* the last panel: bias zero-padded to the panel width */
                        memset(bpad, 0, sizeof(bpad));
                        memcpy(bpad, bp, (size_t)ncols * sizeof(float));
                        bp = bpad;
                    }
                    const float *wpp = wp + p * pstride + k0 * NR;
                    /* the weights of this thread's next kernel step (next panels of this K block,
                     * else the group's first panels in the next K block, the next x block, the next
                     * group), prefetched while this step runs, spread over its row tiles (tile t
                     * takes the t-th 1/tiles of them): the memory stream overlaps the arithmetic
                     * instead of stalling each step's first tile, and later x blocks find them in L1 */
                    int64_t next_p = p, next_k0 = k0, next_k1 = k1;
                    if (p + np < g1) next_p = p + np;
                    else if (kb + 1 < nk) next_p = g0, next_k0 = k1, next_k1 = K * (kb + 2) / nk;
                    else if (b1 < m1) next_p = g0, next_k0 = 0, next_k1 = K / nk;
                    else if (g1 < p1) next_p = g1, next_k0 = 0, next_k1 = K / nk;
#ifndef QW_PF_SINGLE
#define QW_PF_SINGLE 1 /* single-tile steps of up to this many panels */
#endif
                    /* one-tile steps of several panels (1-3 rows) are left to the hardware
                     * prefetcher (measured: the extra prefetches cost more there) */
                    const int pf_on = tiles > 1 || np <= QW_PF_SINGLE;
                    const int64_t lines = pf_on ? next_k1 - next_k0 : 0; /* 64-byte lines per panel */
                    const float *pf = wp + next_p * pstride + next_k0 * NR;
                    /* balanced row tiles: `tiles` tiles of rows / tiles (+1 for the first rows % tiles) */
                    int64_t r = b0;
                    for (int64_t t = 0; t < tiles; t++) {
                        const int mr = (int)(rows / tiles + (t < rows % tiles));
                        const int64_t lo = lines * t / tiles, hi = lines * (t + 1) / tiles;
                        const int64_t rate = kcur > 0 ? ((hi - lo) << 16) / kcur : 0; /* lines per k, 16.16 */
                        TILES[mr][npp](x + r * ldx + k0, ldx, wpp, pstride, kcur, bp, y + r * ldy + c0, ldy, ncols,
                                       kb > 0, pf + lo * NR, rate);
                        r += mr;
                    }
                }
            }
        }
    }
}

/* Cache-blocking defaults (0 = default in qw_gemm_f32's arguments). */
#define QW_K_BLOCK 2048                /* K per block at most: a panel's K block (KC * 64 bytes) and a tile's
                                          x rows (MR * KC * 4) stay in L1 across the x block's tiles */
#define QW_X_BLOCK_BYTES (128 * 1024)  /* x rows per block: MC * KC * 4 bytes <= this */
#define QW_W_GROUP_BYTES (1024 * 1024) /* panels per group (L3-resident): group * K * 64 bytes <= this */

/* The blocking qw_gemm_f32 runs an M x K product with (0 = the default of each knob). */
static void blocking(int64_t M, int64_t K, int64_t *mc, int64_t *group, int64_t *kc) {
    if (*kc <= 0) { /* balanced K blocks of at most QW_K_BLOCK */
        const int64_t nk = (K + QW_K_BLOCK - 1) / QW_K_BLOCK;
        *kc = nk > 0 ? (K + nk - 1) / nk : 1;
    }
    if (*kc > K) *kc = K > 0 ? K : 1;
    if (*mc <= 0) {
        *mc = QW_X_BLOCK_BYTES / (*kc * 4);
        *mc = *mc < MR_MAIN ? MR_MAIN : *mc / MR_MAIN * MR_MAIN;
    }
    if (*group <= 0) {
        *group = QW_W_GROUP_BYTES / (K > 0 ? K * NR * 4 : 4);
        if (*group < 1) *group = 1;
    }
    const int np = panels_for_rows(M < MR_MAIN ? M : MR_MAIN);
    if (*group % np) *group += np - *group % np; /* whole kernel steps per group */
}

/*
 * y[M, N] (rows ldy apart) = x[M, K] (rows ldx apart) @ W^T (+ bias[N] when not NULL), W packed
 * as wp above. mc (rows per x block), group (panels per weight group) and kc (K per block) are
 * cache-blocking knobs for benchmarks: 0 takes the defaults. Returns 0, or -1 for invalid sizes.
 */
int qw_gemm_f32(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy, int64_t M,
                int64_t N, int64_t K, int num_threads, int64_t mc, int64_t group, int64_t kc) {
    if (M < 0 || N < 0 || K < 0 || (M > 0 && (ldx < K || ldy < N))) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t npanels = (N + NR - 1) / NR;
    blocking(M, K, &mc, &group, &kc);
    const int np = panels_for_rows(M < MR_MAIN ? M : MR_MAIN);
    const int64_t units = (npanels + np - 1) / np;
    int nt = num_threads < 1 ? 1 : num_threads;
    /* below ~64k FLOP the fork/join costs more than it saves */
    if ((double)M * (double)N * (double)K < 32768.0) nt = 1;
    /* threads over panel units; when there are fewer units than threads, over rows as well */
    int tn = nt, tm = 1;
    if (units < nt) {
        tn = (int)units;
        tm = nt / tn;
        const int64_t row_tiles = (M + MR_MAIN - 1) / MR_MAIN;
        if (tm > row_tiles) tm = (int)row_tiles;
    }
    nt = tn * tm;
    /* OpenMP may start fewer threads than num_threads asks for (OMP_THREAD_LIMIT, OMP_DYNAMIC,
     * a call from inside another parallel region): each thread of the team takes every team-th
     * share, so all nt shares are computed whatever the team's size */
#pragma omp parallel num_threads(nt) if (nt > 1)
    for (int t = omp_get_thread_num(), team = omp_get_num_threads(); t < nt; t += team) {
        const int it = t % tn, jt = t / tn;
        const int64_t p0 = units * it / tn * np, p1e = units * (it + 1) / tn * np;
        const int64_t p1 = p1e < npanels ? p1e : npanels;
        int64_t m0 = 0, m1 = M;
        if (tm > 1) { /* row ranges in whole main tiles */
            const int64_t row_tiles = (M + MR_MAIN - 1) / MR_MAIN;
            m0 = row_tiles * jt / tm * MR_MAIN;
            m1 = row_tiles * (jt + 1) / tm * MR_MAIN;
            if (m1 > M) m1 = M;
        }
        gemm_range(x, ldx, wp, bias, y, ldy, N, K, m0, m1, p0, p1, mc, group, kc);
    }
    return 0;
}

/* Panels p0..p1 of qw_gemm_f32's product (no bias, default blocking), on the calling thread: for
 * callers that share out the work in a parallel region of their own (csrc/moe_cpu.c). Every output
 * is computed as qw_gemm_f32 computes it, so the bits are the same. */
void qw_gemm_f32_panels(const float *x, int64_t ldx, const float *wp, float *y, int64_t ldy, int64_t M, int64_t N,
                        int64_t K, int64_t p0, int64_t p1) {
    if (M <= 0 || N <= 0) return;
    int64_t mc = 0, group = 0, kc = 0;
    blocking(M, K, &mc, &group, &kc);
    gemm_range(x, ldx, wp, NULL, y, ldy, N, K, 0, M, p0, p1, mc, group, kc);
}

/* The build's vector ISA: 2 = AVX-512, 1 = AVX2+FMA, 0 = generic C (tests check the dispatch). */
int qw_gemm_f32_isa(void) { return QW_GEMM_ISA; }

/* One x row against one panel, the 16 values the tiles compute for its columns: from zero (no
 * bias), k ascending, with the tiles' FMA (or multiply-add in the generic build), so the same
 * bits as qw_gemm_f32 gives for that row and panel at any M, N and thread count (a later K block
 * continues from the stored fp32 partial sums, which changes nothing). For callers that need a
 * few columns exactly: kernels/greedy_head.py's candidates (csrc/greedy_head.c). */
void qw_gemm_f32_panel_row(const float *x, const float *w, int64_t K, float *out) {
#if QW_GEMM_ISA > 0
    vec acc[VPP];
    for (int v = 0; v < VPP; v++) acc[v] = V_ZERO();
    for (int64_t k = 0; k < K; k++) {
        const vec a = V_BCAST(x + k);
        for (int v = 0; v < VPP; v++) acc[v] = V_FMA(a, V_LOAD(w + k * NR + v * VW), acc[v]);
    }
    for (int v = 0; v < VPP; v++) V_STORE(out + v * VW, acc[v]);
#else
    float acc[NR] = {0};
    for (int64_t k = 0; k < K; k++)
        for (int c = 0; c < NR; c++) acc[c] += x[k] * w[k * NR + c];
    memcpy(out, acc, sizeof(acc));
#endif
}
