/*
 * Paged extend (prefill) attention for the CPU engine: each sequence's chunk of new queries,
 * causal over its K/V, read in place through the block table (no gathered copy of the context,
 * no materialised mask).
 *
 * Layout (see kernels/reference.py):
 *   q                [T, Hq, D]                       row t at q + t * q_stride (heads dense)
 *   k/v cache        [num_blocks, block_size, Hkv, D] contiguous, fp32, fp16 or bf16
 *   block_tables     [B, max_blocks] int32            row b at block_tables + b * table_stride
 *   query_start_loc  [B + 1] int32                    sequence b owns rows [qsl[b], qsl[b+1])
 *   seq_lens         [B] int32                        its rows are the last of its seq_lens[b] tokens
 *   out              [T, Hq, D]                       row t at out + t * out_stride
 *
 * Flash-attention style, fp32 throughout: a work item is (sequence, KV head, tile of query rows);
 * its G query heads x tile rows form one block of rows that walks the keys the tile can see in
 * chunks of QW_NK tokens. Each chunk is read from its pages once (converted to fp32, K transposed
 * so that a row's scores for the chunk are QW_NK / VL vector FMAs per head dimension) and used by
 * every row of the block: scores, an online softmax per row (running max and sum, earlier output
 * rescaled when the max grows), then P . V into the row's fp32 output. Under a sliding window a
 * tile reads only the chunks some of its rows can see; masked keys get probability exactly 0.
 * Items run longest first (cost = rows x keys) under dynamic scheduling.
 *
 * Vectors are GCC vector extensions of the build's width (16 floats with AVX-512, 8 with AVX2,
 * 4 otherwise), so the one body serves every ISA build kernels/cpu.py makes; a * b + c contracts
 * to an FMA where the build has FMA (gcc's default -ffp-contract=fast in GNU C).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "exp.h"
#include "paged_extend_plan.h"

#if defined(__AVX512F__)
#define QW_VL 16
#elif defined(__AVX2__)
#define QW_VL 8
#else
#define QW_VL 4
#endif
typedef float qw_vf __attribute__((vector_size(QW_VL * 4)));
typedef float qw_vf_u __attribute__((vector_size(QW_VL * 4), aligned(4))); /* unaligned access */
#define VLOAD(p) (*(const qw_vf_u *)(p))
#define VSTORE(p, v) (*(qw_vf_u *)(p) = (v))

#define QW_NK 32                  /* keys per chunk */
#define QW_NV (QW_NK / QW_VL)     /* vectors per score row */
/* rows per score micro-kernel: AVX-512's 32 registers hold 12 x 2 sums, the chunk's 2 key vectors
 * and a broadcast (2 key loads and 12 broadcasts per 24 FMAs); AVX2's 16 hold 2 x 4 sums */
#define QW_RB (QW_VL == 16 ? 12 : 2)

#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline float qw_x_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float qw_x_f16(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {
        const float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* S[r][0:NK] = Q[r] . Kt[:, 0:NK] for a block of RB rows: Qt holds the block's queries channel by
 * channel (Qt[d * RB + i] = row i's channel d, one base address for every broadcast), S rows NK
 * apart. Each score sums its channels in order d = 0 .. D - 1, whatever RB. */
static inline void qw_x_scores(const float *restrict Qt, const float *restrict Kt, int D, float *restrict S) {
    qw_vf acc[QW_RB][QW_NV];
#pragma GCC unroll 12
    for (int r = 0; r < QW_RB; r++)
#pragma GCC unroll 8
        for (int v = 0; v < QW_NV; v++) acc[r][v] = (qw_vf){0};
    for (int d = 0; d < D; d++) {
        qw_vf k[QW_NV];
#pragma GCC unroll 8
        for (int v = 0; v < QW_NV; v++) {
            k[v] = VLOAD(Kt + (int64_t)d * QW_NK + v * QW_VL);
#if QW_VL == 16
            /* in a register: gcc would otherwise fold the load into each row's FMA, 12 loads of
             * one vector (the load ports, not the FMAs, then bound the kernel) */
            __asm__("" : "+v"(k[v]));
#endif
        }
#pragma GCC unroll 12
        for (int r = 0; r < QW_RB; r++) {
            const float qd = Qt[(int64_t)d * QW_RB + r];
#pragma GCC unroll 8
            for (int v = 0; v < QW_NV; v++) acc[r][v] += qd * k[v];
        }
    }
#pragma GCC unroll 12
    for (int r = 0; r < QW_RB; r++)
#pragma GCC unroll 8
        for (int v = 0; v < QW_NV; v++) VSTORE(S + (int64_t)r * QW_NK + v * QW_VL, acc[r][v]);
}

/* Rows per P . V micro-kernel call: 3 x 4 accumulators + 4 V vectors fill AVX2's 16 registers;
 * AVX-512's 32 hold 6 x 4 (a V row's 4 loads then serve 24 FMAs, not 12) */
#ifndef QW_PV_ROWS
#define QW_PV_ROWS (QW_VL == 16 ? 6 : 3)
#endif

/* O[r] = O[r] * alpha[r] + sum_{j < n} P[r][j] * V[j] for rows r < nr (<= QW_PV_ROWS), columns
 * [d0, d0 + 4 VL). Each row's sum runs over j in order, whatever the rows around it. */
static inline void qw_x_pv4(const float *restrict P, const float *restrict V, int n, int D, int d0, int nr,
                            const float *restrict alpha, float *restrict O) {
    qw_vf acc[QW_PV_ROWS][4];
#pragma GCC unroll 6
    for (int r = 0; r < QW_PV_ROWS; r++)
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) acc[r][v] = r < nr ? VLOAD(O + (int64_t)r * D + d0 + v * QW_VL) * alpha[r] : (qw_vf){0};
    for (int j = 0; j < n; j++) {
        qw_vf x[4];
#pragma GCC unroll 4
        for (int v = 0; v < 4; v++) x[v] = VLOAD(V + (int64_t)j * D + d0 + v * QW_VL);
#pragma GCC unroll 6
        for (int r = 0; r < QW_PV_ROWS; r++) {
            const float p = P[(int64_t)r * QW_NK + j];
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) acc[r][v] += p * x[v];
        }
    }
#pragma GCC unroll 6
    for (int r = 0; r < QW_PV_ROWS; r++)
        if (r < nr)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) VSTORE(O + (int64_t)r * D + d0 + v * QW_VL, acc[r][v]);
}

/* the columns [d0, D) that do not fill 4 vectors: one row, one column at a time */
static inline void qw_x_pv_tail(const float *restrict P, const float *restrict V, int n, int D, int d0,
                                float alpha, float *restrict O) {
    for (int d = d0; d < D; d++) {
        float a = O[d] * alpha;
        for (int j = 0; j < n; j++) a = fmaf(P[j], V[(int64_t)j * D + d], a);
        O[d] = a;
    }
}

/* O[r] = O[r] * alpha[r] + P[r] . V for rows [0, nr) */
static void qw_x_pv(const float *restrict P, const float *restrict V, int n, int D, int nr,
                    const float *restrict alpha, float *restrict O) {
    const int d4 = D / (4 * QW_VL) * (4 * QW_VL);
    for (int r = 0; r < nr; r += QW_PV_ROWS) {
        const int m = nr - r < QW_PV_ROWS ? nr - r : QW_PV_ROWS;
        for (int d0 = 0; d0 < d4; d0 += 4 * QW_VL)
            qw_x_pv4(P + (int64_t)r * QW_NK, V, n, D, d0, m, alpha + r, O + (int64_t)r * D);
        if (d4 < D)
            for (int i = 0; i < m; i++)
                qw_x_pv_tail(P + (int64_t)(r + i) * QW_NK, V, n, D, d4, alpha[r + i], O + (int64_t)(r + i) * D);
    }
}

static int qw_x_cmp(const void *a, const void *b) {
    const int64_t x = ((const qw_x_item *)a)->cost, y = ((const qw_x_item *)b)->cost;
    return (x < y) - (x > y);
}

int64_t qw_x_plan(int B, int Hkv, int tm, int block_size, int window, int64_t num_blocks, const int32_t *block_tables,
                  int64_t table_stride, const int32_t *query_start_loc, const int32_t *seq_lens, qw_x_item **items) {
    *items = NULL;
    int64_t n_items = 0;
    for (int b = 0; b < B; b++) {
        const int M = query_start_loc[b + 1] - query_start_loc[b], len = seq_lens[b];
        if (M < 0 || M > len) return -2;
        const int first = window > 0 && len - M + 1 - window > 0 ? (len - M + 1 - window) / block_size : 0;
        if (M > 0)
            for (int i = first; i * block_size < len; i++)
                if (block_tables[b * table_stride + i] < 0 || block_tables[b * table_stride + i] >= num_blocks) return -2;
        n_items += (int64_t)Hkv * ((M + tm - 1) / tm);
    }
    if (n_items == 0) return 0;
    qw_x_item *list = malloc(sizeof(qw_x_item) * (size_t)n_items);
    if (!list) return -1;
    int64_t at = 0;
    for (int b = 0; b < B; b++) {
        const int M = query_start_loc[b + 1] - query_start_loc[b], prefix = seq_lens[b] - M;
        for (int i0 = 0; i0 < M; i0 += tm) {
            const int i1 = i0 + tm < M ? i0 + tm : M;
            const int lo = window > 0 && prefix + i0 - window + 1 > 0 ? prefix + i0 - window + 1 : 0;
            for (int h = 0; h < Hkv; h++)
                list[at++] = (qw_x_item){(int64_t)(i1 - i0) * (prefix + i1 - lo), b, h, i0, i1};
        }
    }
    qsort(list, (size_t)n_items, sizeof(qw_x_item), qw_x_cmp);
    *items = list;
    return n_items;
}

#define QW_CAT2(a, b) a##_##b
#define QW_CAT(a, b) QW_CAT2(a, b)

#define KV_T float
#define LOAD1(p) (*(p))
#define FN(name) QW_CAT(name, f32)
#include "paged_extend_impl.h"
#undef KV_T
#undef LOAD1
#undef FN

#define KV_T uint16_t
#define LOAD1(p) qw_x_f16(*(p))
#define FN(name) QW_CAT(name, f16)
#include "paged_extend_impl.h"
#undef KV_T
#undef LOAD1
#undef FN

#define KV_T uint16_t
#define LOAD1(p) qw_x_bf16(*(p))
#define FN(name) QW_CAT(name, bf16)
#include "paged_extend_impl.h"
#undef KV_T
#undef LOAD1
#undef FN
