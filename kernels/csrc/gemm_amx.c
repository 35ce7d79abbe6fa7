/*
 * GEMM with bf16 WEIGHTS on AMX (Sapphire Rapids and later): y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
 * the same call as csrc/gemm_bf16.c's qw_gemm_bf16 (which kernels/gemm_cpu.py and the bf16 layer
 * loop in csrc/decoder_layers.c take as a function pointer), for bf16 x. AMX multiplies 16 x 32
 * bf16 tiles into 16 x 16 fp32 tiles (TDPBF16PS: 8192 multiply-adds an instruction), many times
 * the AVX512_BF16 dot-product kernel's rate, which is what prefill chunks and large decode batches
 * are bound by; at small batches the call streams the weights once, as every path does.
 *
 * Weights are packed once at load in AMX's B-operand layout (kernels/gemm_cpu.py pack_weight):
 *
 *   wp [P = ceil(N / 16)][K / 2][16][2] uint16 (bf16 bits)   wp[p][k2][c][j] = W[16p + c][2 k2 + j]
 *                                                              (columns past N are zero)
 *
 * so the B tile of panel p, K block kb (32 k) is the 1 KiB at wp + (p * K / 2 + kb * 16) * 32,
 * 16 rows of 64 bytes. K must be a multiple of 32 (the packer keeps the panels layout otherwise).
 *
 * A tiles are loaded from x in place (bf16, rows ldx apart; TILELOADD takes the row stride), but
 * for a last row tile of fewer than 16 rows, which is copied into a zero-padded 16 x K buffer so
 * that no tile reads past x. (A copy of all of x in tile order cost a serial pass and a fresh
 * allocation per call, ~6% of a prefill step, for no faster tile loads.)
 * bias: fp32, bf16 or NULL (copied into a zero-padded fp32 row, added once to the finished sums).
 * y: fp32, or bf16 rounded to nearest even (NaN -> 0x7fc0, as the other kernels). Each output is
 * one fp32 sum over all of K in its C tile (no K blocks), so results differ from the other
 * kernels' in rounding only, and a row's result depends on nothing else in the batch (the tiles'
 * rows are independent; threads split the columns).
 *
 * Blocking (8 tile registers): up to 16 rows, one A tile and three panels (3 C + 1 A + 3 B);
 * more rows, two A tiles by two panels (4 C + 2 A + 2 B), each block's epilogue run a few rows at a
 * time between the next block's products. Threads take contiguous panel ranges; each configures
 * its tiles and releases them when done. The process asks the kernel for AMX state once
 * (arch_prctl ARCH_REQ_XCOMP_PERM): qw_gemm_bf16_amx_ready() says whether that worked.
 *
 * Two more entry points change only the epilogue: qw_gemm_bf16_amx_swiglu (a gate/up projection's
 * SwiGLU activation instead of its product) and qw_gemm_bf16_amx_argmax (each row's argmax, for an
 * LM head whose rows want only the greedy token), each the same answer as the plain GEMM's bf16
 * output followed by the separate kernel.
 *
 * Against oneDNN's packed AMX linear (docs/benchmarks.md, `bench/gemm_paths.py --dtype bfloat16`):
 * ahead at 1-48 rows, 0.75-0.82x at 128-512. Neither contiguous A tiles nor K chunks that keep
 * the weights in L1 moved the many-row figures by more than the noise; the loads' order in the
 * 2 x 2 kernel (each product as soon as its operands are in) gave ~5%.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "bf16.h"
#include "silu.h"
#include "wide.h"

#if defined(QW_GEMM_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#define QW_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define QW_AMX 0
#endif

#define NR 16     /* columns per panel (a C tile's width) */
#define KT 32     /* k per tile */
#define MT 16     /* rows per tile */
#ifndef QW_MC_BYTES
#define QW_MC_BYTES (1 << 19) /* bytes of A per block of rows (amx_range); -D for trials */
#endif

#if QW_AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state = -1; /* -1 not asked yet, 0 refused, 1 granted */

static int amx_ready(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s < 0) { /* asking twice is harmless, so a race here costs one more syscall */
#ifdef QW_AMX_EMULATE
        s = 1; /* the tiles are software (amx_emulate.h): nothing to ask the OS for */
#else
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#endif
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s;
}

#include "amx_tiles.h"

/* the finished 16 x 16 sums (c, 16 floats a row) + bias -> rows [0, rows) x columns [0, ncols) of y */
static void store_tile(const float *c, const float *bias, void *y, int64_t ldy, int ybf, int rows, int ncols) {
    const __mmask16 m = (__mmask16)((1u << ncols) - 1u);
    const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int i = 0; i < rows; i++)
        store16_f32_or_bf16((char *)y + i * ldy * (ybf ? 2 : 4), ybf, _mm512_add_ps(_mm512_loadu_ps(c + i * NR), b), m);
}

/* One row tile (16 rows at a, lda elements apart) by NP (1-3) panels, the first at b and each next
 * pd elements on (K * NR for neighbours; the gate/up product's pairs are further apart): C tiles
 * 0..NP-1, A tile 4, B 5..7. */
#define ROW_TILE_BY_PANELS(NP)                                                                                      \
    static void rows16_by_##NP(const uint16_t *a, int64_t lda, int64_t K, const uint16_t *b, int64_t pd, float *c) { \
        _tile_zero(0);                                                                                              \
        if (NP > 1) _tile_zero(1);                                                                                  \
        if (NP > 2) _tile_zero(2);                                                                                  \
        for (int64_t k = 0; k < K; k += KT, b += KT * NR) {                                                         \
            _tile_loadd(4, a + k, lda * 2);                                                                         \
            _tile_loadd(5, b, 64);                                                                                  \
            _tile_dpbf16ps(0, 4, 5);                                                                                \
            if (NP > 1) {                                                                                           \
                _tile_loadd(6, b + pd, 64);                                                                         \
                _tile_dpbf16ps(1, 4, 6);                                                                            \
            }                                                                                                       \
            if (NP > 2) {                                                                                           \
                _tile_loadd(7, b + 2 * pd, 64);                                                                     \
                _tile_dpbf16ps(2, 4, 7);                                                                            \
            }                                                                                                       \
        }                                                                                                           \
        _tile_stored(0, c, 64);                                                                                     \
        if (NP > 1) _tile_stored(1, c + MT * NR, 64);                                                               \
        if (NP > 2) _tile_stored(2, c + 2 * MT * NR, 64);                                                           \
        TILES_STORED();                                                                                             \
    }
ROW_TILE_BY_PANELS(1)
ROW_TILE_BY_PANELS(2)
ROW_TILE_BY_PANELS(3)

/* A thread's running argmax of each row over the columns it has seen (qw_gemm_bf16_amx_argmax):
 * per row, each of 16 lanes keeps the largest bf16-rounded value of the columns = lane (mod 16)
 * and the first column that held it (panels come in increasing order, and only a strictly
 * greater value replaces), plus the row's first NaN column (-1: none yet). */
typedef struct {
    float *vmax;        /* [M][16] */
    int32_t *vidx;      /* [M][16] */
    int64_t *nan_first; /* [M] */
} argmax_acc;

/* rows [0, rows) of a tile of sums c (16 floats a row) for columns [c0, c0 + ncols) into am from
 * row r0; each sum rounded to bf16 first, as the logits the argmax would otherwise read */
static inline void argmax_tile_rows(argmax_acc *am, int64_t r0, const float *c, int64_t c0, int ncols, int i0,
                                    int rows) {
    const __mmask16 m = (__mmask16)((1u << ncols) - 1u);
    const __m512i col = _mm512_add_epi32(_mm512_set1_epi32((int)c0), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    for (int i = i0; i < rows; i++) {
        const int64_t r = r0 + i;
        const __m512 raw = _mm512_loadu_ps(c + i * NR);
        const __mmask16 nan = _mm512_mask_cmp_ps_mask(m, raw, raw, _CMP_UNORD_Q);
        if (nan && am->nan_first[r] < 0) am->nan_first[r] = c0 + __builtin_ctz(nan);
        const __m512 v = _mm512_castsi512_ps(round_bf16_16(raw)), best = _mm512_loadu_ps(am->vmax + r * NR);
        const __mmask16 gt = _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ);
        _mm512_storeu_ps(am->vmax + r * NR, _mm512_mask_mov_ps(best, gt, v));
        _mm512_storeu_si512(am->vidx + r * NR, _mm512_mask_mov_epi32(_mm512_loadu_si512(am->vidx + r * NR), gt, col));
    }
}

/* A finished block of sums waiting for its epilogue: up to 2 row tiles x 2 panels of fp32 sums at c
 * (tile (row tile t, panel j of the pair) at 2t + j), each tile's valid rows and columns, where
 * they go (y: tile (t, j) at y + t * 16 rows + j * 16 columns, or the gate/up product's activation)
 * and the bias. Its rows are written in slots of two rows of one tile (32 slots; 16 for gate/up,
 * whose slot is two rows of a gate tile and of its up tile together), so that the epilogue can run
 * a few slots at a time between the next block's tile products (see rows32_by_2). */
typedef struct {
    const float *c;
    int rows[2], ncols[2]; /* valid rows of row tile t (0: none), columns of panel j */
    char *y;               /* tile (0, 0)'s first element */
    int64_t ldy;
    int ybf, up;
    const float *bias;     /* the pair's 32 padded bias values, or NULL */
    argmax_acc *am;        /* argmax instead of y: the block's first row and column */
    int64_t r0, c0;
} pending;

#define SLOTS 32 /* two-row slots of a block's four tiles */

/* slots [s0, s1) of e (slots past its end are ignored) */
static inline void epilogue_slots(const pending *e, int s0, int s1) {
    const int esz = e->ybf ? 2 : 4;
    if (e->up) { /* slot s: rows 2 (s % 8), + 1 of row tile s / 8, gate tile 2t, up tile 2t + 1 */
        for (int s = s0; s < s1 && s < SLOTS / 2; s++) {
            const int t = s / 8, i = 2 * (s % 8);
            if (i >= e->rows[t]) continue;
            const float *cg = e->c + 2 * t * MT * NR + i * NR, *cu = cg + MT * NR;
            uint16_t o[2 * NR] __attribute__((aligned(64)));
#pragma omp simd
            for (int x = 0; x < 2 * NR; x++)
                o[x] = f32_to_bf16(silu_mul(bf16_to_f32(f32_to_bf16(cg[x])), bf16_to_f32(f32_to_bf16(cu[x]))));
            uint16_t *dst = (uint16_t *)e->y + (t * MT + i) * e->ldy;
            memcpy(dst, o, NR * 2);
            if (i + 1 < e->rows[t]) memcpy(dst + e->ldy, o + NR, NR * 2);
        }
        return;
    }
    for (int s = s0; s < s1 && s < SLOTS; s++) { /* slot s: rows 2 (s % 8), + 1 of tile s / 8 = 2t + j */
        const int tile = s / 8, t = tile / 2, j = tile % 2, i = 2 * (s % 8);
        if (i >= e->rows[t] || !e->ncols[j]) continue;
        if (e->am) {
            argmax_tile_rows(e->am, e->r0 + t * MT, e->c + tile * MT * NR, e->c0 + j * NR, e->ncols[j], i,
                             i + 2 < e->rows[t] ? i + 2 : e->rows[t]);
            continue;
        }
        const __mmask16 m = (__mmask16)((1u << e->ncols[j]) - 1u);
        const __m512 b = e->bias ? _mm512_loadu_ps(e->bias + j * NR) : _mm512_setzero_ps();
        for (int r = i; r < i + 2 && r < e->rows[t]; r++)
            store16_f32_or_bf16(e->y + ((t * MT + r) * e->ldy + j * NR) * esz, e->ybf,
                                _mm512_add_ps(_mm512_loadu_ps(e->c + tile * MT * NR + r * NR), b), m);
    }
}

/* Two row tiles (16 rows at a0, 16 at a1, lda0 / lda1 elements apart) by two panels (at b and
 * b + pd): C tiles 0-3 (row tile r, panel j at 2r + j), A tiles 4-5, B tiles 6-7. The epilogue of
 * the previous block (prev, or NULL) runs a few slots after each k step's products: the vector
 * work then overlaps the tile unit's instead of waiting between blocks (~10-15% at 1024 rows of
 * K = 576, where a block is only 18 k steps). */
QW_WIDE static void rows32_by_2(const uint16_t *a0, int64_t lda0, const uint16_t *a1, int64_t lda1, int64_t K,
                        const uint16_t *b, int64_t pd, float *c, const pending *prev) {
    const int steps = (int)(K / KT), per = (SLOTS + steps - 1) / steps;
    int slot = 0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += KT, b += KT * NR) {
        /* each product issued as soon as its operands are loaded, so loads overlap products */
        _tile_loadd(4, a0 + k, lda0 * 2);
        _tile_loadd(6, b, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b + pd, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + k, lda1 * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        if (prev) {
            epilogue_slots(prev, slot, slot + per);
            slot += per;
        }
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + MT * NR, 64);
    _tile_stored(2, c + 2 * MT * NR, 64);
    _tile_stored(3, c + 3 * MT * NR, 64);
    TILES_STORED();
}

/* Where row tile t's 16 rows are: in x, or (a last tile of fewer than 16 rows) in the padded tail. */
typedef struct {
    const uint16_t *x, *tail;
    int64_t ldx, K, full; /* full: the row tiles wholly inside x */
} row_tiles;

static inline const uint16_t *tile_rows(const row_tiles *a, int64_t t, int64_t *lda) {
    if (t < a->full) {
        *lda = a->ldx;
        return a->x + t * MT * a->ldx;
    }
    *lda = a->K;
    return a->tail;
}

/* panels [p0, p1) of y for all M rows (Mp: M rounded up to whole row tiles); bias padded fp32 or
 * NULL. up > 0: the gate/up product (qw_gemm_bf16_amx_swiglu): [p0, p1) are gate panels, each
 * paired with the up panel `up` panels on, and y is the bf16 activation [M, up * NR]. */
QW_WIDE static void amx_range(const row_tiles *a, int64_t M, int64_t Mp, int64_t K, const uint16_t *wp, const float *bias,
                      void *y, int64_t ldy, int ybf, int64_t N, int64_t p0, int64_t p1, int64_t up, argmax_acc *am) {
    const int esz = ybf ? 2 : 4;
    const int64_t ps = K * NR, pd = (up ? up : 1) * ps; /* elements per panel; from a pair's first panel to its second */
    float c[4 * MT * NR] __attribute__((aligned(64)));
    int64_t lda, lda1;
    qw_configure_tiles();
    if (Mp == MT && up) { /* one row tile of the gate/up product: a gate and an up panel at a time */
        const uint16_t *a0 = tile_rows(a, 0, &lda);
        for (int64_t p = p0; p < p1; p++) {
            rows16_by_2(a0, lda, K, wp + p * ps, pd, c); /* gate tile at c, up tile next: a pending block's layout */
            const pending e = {.c = c, .rows = {(int)M, 0}, .y = (char *)((uint16_t *)y + p * NR), .ldy = ldy, .ybf = 1, .up = 1};
            epilogue_slots(&e, 0, SLOTS);
        }
    } else if (Mp == MT) { /* one row tile: three panels at a time */
        const uint16_t *a0 = tile_rows(a, 0, &lda);
        for (int64_t p = p0; p < p1; p += 3) {
            const int np = (int)(p1 - p < 3 ? p1 - p : 3);
            if (np == 3) rows16_by_3(a0, lda, K, wp + p * ps, ps, c);
            else if (np == 2) rows16_by_2(a0, lda, K, wp + p * ps, ps, c);
            else rows16_by_1(a0, lda, K, wp + p * ps, ps, c);
            for (int j = 0; j < np; j++) {
                const int64_t c0 = (p + j) * NR;
                const int ncols = (int)(N - c0 < NR ? N - c0 : NR);
                if (am) argmax_tile_rows(am, 0, c + j * MT * NR, c0, ncols, 0, (int)M);
                else store_tile(c + j * MT * NR, bias ? bias + c0 : NULL, (char *)y + c0 * esz, ldy, ybf, (int)M, ncols);
            }
        }
    } else {
        /* rows in blocks whose A fits in L2 (QW_MC_BYTES of it), every panel pair over one block
         * before the next: each pair then re-reads its rows from L2, not from L3 (1024 rows of K =
         * 1536 are 3 MiB of A). The weights are read once per block instead of once; the sums are
         * the same tiles' in the same order. 25% faster at 2048 rows, ~5% at 1024 (docs/benchmarks.md) */
        const int64_t fit = QW_MC_BYTES / (K * 2) / (2 * MT) * (2 * MT), mc = fit > 2 * MT ? fit : 2 * MT;
        /* a block's sums go to one of two buffers while the other's epilogue is pending */
        float cs[2][4 * MT * NR] __attribute__((aligned(64)));
        pending e[2];
        int cur = 0, waiting = 0;
        for (int64_t rb = 0; rb < Mp; rb += mc) {
            for (int64_t p = p0; p < p1; p += up ? 1 : 2) {
                const int np = up || p1 - p >= 2 ? 2 : 1;
                for (int64_t r = rb; r < Mp && r < rb + mc; r += 2 * MT) {
                    const int nr = Mp - r >= 2 * MT ? 2 : 1;
                    const uint16_t *a0 = tile_rows(a, r / MT, &lda);
                    float *cb = cs[cur];
                    if (nr == 2 && np == 2) {
                        const uint16_t *a1 = tile_rows(a, r / MT + 1, &lda1);
                        rows32_by_2(a0, lda, a1, lda1, K, wp + p * ps, pd, cb, waiting ? &e[!cur] : NULL);
                    } else { /* an odd last row tile or panel: one row tile at a time, after the epilogue */
                        if (waiting) epilogue_slots(&e[!cur], 0, SLOTS);
                        for (int t = 0; t < nr; t++) {
                            const uint16_t *at = tile_rows(a, r / MT + t, &lda1);
                            if (np == 2) rows16_by_2(at, lda1, K, wp + p * ps, pd, cb + 2 * t * MT * NR);
                            else rows16_by_1(at, lda1, K, wp + p * ps, pd, cb + 2 * t * MT * NR);
                        }
                    }
                    pending *n = &e[cur];
                    n->c = cb, n->ldy = ldy, n->ybf = ybf, n->up = up != 0, n->am = am, n->r0 = r, n->c0 = p * NR;
                    for (int t = 0; t < 2; t++) {
                        const int64_t r0 = r + t * MT;
                        n->rows[t] = t < nr && r0 < M ? (int)(M - r0 < MT ? M - r0 : MT) : 0;
                    }
                    if (up) {
                        n->y = (char *)((uint16_t *)y + r * ldy + p * NR);
                        n->bias = NULL;
                    } else {
                        for (int j = 0; j < 2; j++) {
                            const int64_t c0 = (p + j) * NR;
                            n->ncols[j] = j < np ? (int)(N - c0 < NR ? N - c0 : NR) : 0;
                        }
                        n->y = am ? NULL : (char *)y + (r * ldy + p * NR) * esz; /* the argmax writes no y */
                        n->bias = bias ? bias + p * NR : NULL;
                    }
                    waiting = 1;
                    cur = !cur;
                }
            }
        }
        if (waiting) epilogue_slots(&e[!cur], 0, SLOTS);
    }
    _tile_release();
}

/* A row's argmax from the threads' accumulators (thread t's columns all before thread t + 1's): the
 * first NaN, else the first column of the largest value (torch.argmax's answer) */
static int64_t argmax_merge(const argmax_acc *acc, int nt, int64_t r) {
    int64_t nan = -1, best = 0;
    float m = 0.0f;
    for (int t = 0; t < nt; t++)
        if (acc[t].nan_first[r] >= 0 && (nan < 0 || acc[t].nan_first[r] < nan)) nan = acc[t].nan_first[r];
    if (nan >= 0) return nan;
    for (int t = 0; t < nt; t++)
        for (int l = 0; l < NR; l++) {
            const float v = acc[t].vmax[r * NR + l];
            const int64_t i = acc[t].vidx[r * NR + l];
            if ((t == 0 && l == 0) || v > m || (v == m && i < best)) m = v, best = i;
        }
    return best;
}

/* qw_gemm_bf16_amx on AMX tiles (the OS granted them); up > 0: qw_gemm_bf16_amx_swiglu's gate/up
 * product (N = 2 * up * NR, no bias, K > 0), y the bf16 activation; argmax != NULL:
 * qw_gemm_bf16_amx_argmax (no bias, K > 0, y unused), each row's argmax there */
static int amx_gemm(const void *x, int64_t ldx, const uint16_t *wp, const void *bias, int bias_bf16, void *y,
                    int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads, int64_t up,
                    int64_t *argmax) {
    if (M == 0 || N == 0) return 0;
    if (K == 0) { /* no products: the bias (or zeros), before any scratch is allocated */
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = 0; n < N; n++) {
                const float v = !bias ? 0.0f : bias_bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
                if (y_bf16) ((uint16_t *)y)[i * ldy + n] = f32_to_bf16(v);
                else ((float *)y)[i * ldy + n] = v;
            }
        return 0;
    }
    const int64_t P = up ? up : (N + NR - 1) / NR, Mp = (M + MT - 1) / MT * MT, full = M / MT, left = M - full * MT;
    uint16_t *tail = left ? malloc((size_t)(MT * K * 2)) : NULL;
    float *bp = bias ? calloc((size_t)(P * NR), sizeof(float)) : NULL;
    if ((left && !tail) || (bias && !bp)) {
        free(tail), free(bp);
        return -2;
    }
    if (left) { /* the last rows, zero-padded to a whole tile */
        for (int64_t i = 0; i < left; i++) memcpy(tail + i * K, (const uint16_t *)x + (full * MT + i) * ldx, (size_t)K * 2);
        memset(tail + left * K, 0, (size_t)((MT - left) * K * 2));
    }
    const row_tiles a = {(const uint16_t *)x, tail, ldx, K, full};
    if (bias)
        for (int64_t n = 0; n < N; n++) bp[n] = bias_bf16 ? bf16_to_f32(((const uint16_t *)bias)[n]) : ((const float *)bias)[n];
    int nt = num_threads < 1 ? 1 : num_threads;
    if (nt > P) nt = (int)P;
    if ((double)M * (double)N * (double)K < 65536.0) nt = 1; /* fork/join would cost more */
    /* panel shares in whole blocks of the row-tile kernel's width, so no thread gets a ragged one
     * (the gate/up product's unit is a gate panel, which brings its up panel) */
    const int width = up ? 1 : Mp == MT ? 3 : 2;
    const int64_t units = (P + width - 1) / width;
    if (nt > units) nt = (int)units;
    argmax_acc acc[nt];
    char *scratch = NULL;
    if (argmax) { /* each thread's accumulators, (M x 16 floats, M x 16 ints, M ints) */
        const size_t per = (size_t)M * (NR * 8 + 8);
        scratch = aligned_alloc(64, ((size_t)nt * per + 63) / 64 * 64);
        if (!scratch) {
            free(tail), free(bp);
            return -2;
        }
        for (int t = 0; t < nt; t++) {
            char *at = scratch + t * per;
            acc[t] = (argmax_acc){(float *)at, (int32_t *)(at + (size_t)M * NR * 4), (int64_t *)(at + (size_t)M * NR * 8)};
        }
    }
#pragma omp parallel num_threads(nt) if (nt > 1)
    for (int t = omp_get_thread_num(), team = omp_get_num_threads(); t < nt; t += team) {
        const int64_t p0 = units * t / nt * width, p1e = units * (t + 1) / nt * width;
        if (argmax) { /* -inf in every lane, at the range's first columns (a lane that never sees more keeps one) */
            for (int64_t r = 0; r < M; r++) {
                for (int l = 0; l < NR; l++) {
                    acc[t].vmax[r * NR + l] = -INFINITY;
                    acc[t].vidx[r * NR + l] = (int32_t)(p0 * NR + l);
                }
                acc[t].nan_first[r] = -1;
            }
        }
        amx_range(&a, M, Mp, K, wp, bp, y, ldy, y_bf16 != 0, N, p0, p1e < P ? p1e : P, up, argmax ? &acc[t] : NULL);
    }
    if (argmax)
        for (int64_t r = 0; r < M; r++) argmax[r] = argmax_merge(acc, nt, r);
    free(tail), free(bp), free(scratch);
    return 0;
}
#endif

int qw_gemm_bf16_pairs(const void *, int64_t, int, const uint16_t *, const void *, int, void *, int64_t, int, int64_t,
                       int64_t, int64_t, int, int64_t, int64_t, int64_t);
int qw_gemm_bf16_pairs_built(void);

/*
 * The same arguments as qw_gemm_bf16 (csrc/gemm_bf16.c), W packed as above; x must be bf16
 * (x_bf16 = 1) and K a multiple of 32; mc/group/kc are ignored. On AMX tiles where the OS grants
 * them, else with AVX512_BF16 dot products on the same layout (csrc/gemm_pairs.c). Returns 0; -1
 * for invalid sizes or fp32 x; -2 when scratch memory cannot be allocated; -3 where this build
 * has neither.
 */
int qw_gemm_bf16_amx(const void *x, int64_t ldx, int x_bf16, const uint16_t *wp, const void *bias, int bias_bf16,
                     void *y, int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads, int64_t mc,
                     int64_t group, int64_t kc) {
    if (M < 0 || N < 0 || K < 0 || K % KT || !x_bf16 || (M > 0 && (ldx < K || ldy < N))) return -1;
#if QW_AMX
    if (amx_ready()) return amx_gemm(x, ldx, wp, bias, bias_bf16, y, ldy, y_bf16, M, N, K, num_threads, 0, NULL);
#endif
    return qw_gemm_bf16_pairs(x, ldx, x_bf16, wp, bias, bias_bf16, y, ldy, y_bf16, M, N, K, num_threads, mc, group, kc);
}

/* Which kernel qw_gemm_bf16_amx runs here: 2 AMX tiles (this build has them and the OS grants this
 * process AMX state), 1 AVX512_BF16 dot products, 0 neither (it refuses every call) */
int qw_gemm_bf16_amx_ready(void) {
#if QW_AMX
    if (amx_ready()) return 2;
#endif
    return qw_gemm_bf16_pairs_built();
}

/*
 * act[M, I] = silu(x Wg^T) * (x Wu^T) for a gate/up projection W = [Wg; Wu] ([2I, K], packed as
 * above): the GEMM with SwiGLU's activation in its epilogue, the same bits as qw_gemm_bf16_amx
 * with bf16 y followed by csrc/elementwise.c's qw_silu_mul_bf16, without writing the [M, 2I]
 * product and reading it back (7% of a bf16 prefill step, docs/benchmarks.md). Each gate panel is
 * paired with its up panel I / 16 panels on, so I must be a multiple of 16 (no panel holds both).
 * x bf16 [M, K] rows ldx apart, act rows ldy apart. Returns 0; -1 for invalid sizes; -2 when
 * scratch memory cannot be allocated; -3 where this kernel does not apply (no AMX tiles here,
 * I % 16, K = 0): the caller then makes the two calls.
 */
int qw_gemm_bf16_amx_swiglu(const void *x, int64_t ldx, const uint16_t *wp, uint16_t *act, int64_t ldy, int64_t M,
                            int64_t I, int64_t K, int num_threads) {
    if (M < 0 || I < 0 || K < 0 || K % KT || (M > 0 && (ldx < K || ldy < I))) return -1;
    if (I % NR || K == 0) return -3;
#if QW_AMX
    if (amx_ready()) return amx_gemm(x, ldx, wp, NULL, 0, act, ldy, 1, M, 2 * I, K, num_threads, I / NR, NULL);
#endif
    return -3;
}

/*
 * out[r] = argmax_n (x W^T)[r, n] for a packed W [N, K] (no bias): the index torch.argmax gives on
 * the bf16 output of qw_gemm_bf16_amx (each sum rounded to bf16; the first index of the maximum,
 * or of the first NaN), without writing the [M, N] product or reading it back. For a bf16 LM head
 * whose rows want only their greedy token: at 128 rows of a 49,152-token vocabulary that output is
 * 12 MiB a step. x bf16 [M, K] rows ldx apart. Returns 0; -1 for invalid sizes; -2 when scratch
 * memory cannot be allocated; -3 where this kernel does not apply (no AMX tiles here, K = 0, N
 * past int32): the caller then takes the GEMM's logits.
 */
int qw_gemm_bf16_amx_argmax(const void *x, int64_t ldx, const uint16_t *wp, int64_t M, int64_t N, int64_t K,
                            int64_t *out, int num_threads) {
    if (M < 0 || N < 1 || K < 0 || K % KT || (M > 0 && ldx < K)) return -1;
    if (K == 0 || N > INT32_MAX - NR) return -3;
#if QW_AMX
    if (amx_ready()) return M == 0 ? 0 : amx_gemm(x, ldx, wp, NULL, 0, NULL, 0, 1, M, N, K, num_threads, 0, out);
#endif
    return -3;
}
