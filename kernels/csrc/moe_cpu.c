/*
 * A sparse mixture-of-experts MLP in one call (fp32, experts packed in csrc/gemm_f32.c's panels):
 * what qworker.model.moe.MoE's grouped CPU path does with ~10 torch calls and two GEMM calls per
 * active expert, each a parallel region of its own (at a decode step of a 64-expert layer, ~40
 * OpenMP fork/joins a layer, whose barriers wait for any descheduled thread).
 *
 * The routed (token, expert) pairs are sorted by expert (stable), and one parallel region runs:
 * the gather of each pair's input row; every active expert's gate_up GEMM on its rows, shared out
 * by (expert, 8-panel chunk); the SwiGLU; every expert's down GEMM the same way; each pair's
 * output times its routing weight; and per token the sum of its pairs in ascending expert order,
 * from zero. Each of these computes exactly what the grouped path computes (the same GEMM and
 * SwiGLU code, products rounded before the sums, the sums in the same order), so the result is
 * the same to the bit, whatever the thread count.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void qw_gemm_f32_panels(const float *x, int64_t ldx, const float *wp, float *y, int64_t ldy, int64_t M, int64_t N,
                        int64_t K, int64_t p0, int64_t p1);
void qw_silu_mul_f32_row(const float *g, const float *u, float *o, int I);

#define NR 16    /* panel width (gemm_f32.c) */
#define CHUNK 8  /* panels per GEMM work item: 128 columns */

/*
 * out[T, H] = sum over k of weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k].
 * x [T, H], ids [T, topk] (distinct experts per token, each in 0..E-1), weights [T, topk];
 * gate_up[e] / down[e]: the addresses of expert e's packed [2I, H] and [H, I] weights. silu_row:
 * the SwiGLU row function to use (the build the other elementwise kernels run, which may not be
 * this GEMM's build), or NULL for this build's.
 * Returns 0; -1 for an expert id out of range or topk outside 1..64; -2 when scratch memory
 * cannot be allocated.
 */
typedef void (*silu_row_fn)(const float *g, const float *u, float *o, int I);

int qw_moe_f32(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, int64_t topk, const int64_t *ids,
               const float *weights, const int64_t *gate_up, const int64_t *down, float *out, int num_threads,
               silu_row_fn silu_row) {
    if (!silu_row) silu_row = qw_silu_mul_f32_row;
    const int64_t P = T * topk;
    if (topk < 1 || topk > 64) return -1;
    if (T <= 0) return 0;
    for (int64_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return -1;
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *order = malloc(sizeof(int64_t) * (size_t)P); /* sorted position -> pair */
    int64_t *where = malloc(sizeof(int64_t) * (size_t)P); /* pair -> sorted position */
    int64_t *experts = malloc(sizeof(int64_t) * (size_t)E);
    float *rows = malloc(sizeof(float) * (size_t)(P * H)); /* each pair's input row, later its output */
    float *gu = malloc(sizeof(float) * (size_t)(P * 2 * I));
    float *act = malloc(sizeof(float) * (size_t)(P * I));
    int rc = 0;
    if (!start || !order || !where || !experts || !rows || !gu || !act) {
        rc = -2;
        goto done;
    }
    for (int64_t p = 0; p < P; p++) start[ids[p] + 1]++;
    int64_t active = 0;
    for (int64_t e = 0; e < E; e++) {
        if (start[e + 1]) experts[active++] = e;
        start[e + 1] += start[e];
    }
    { /* stable counting sort: a token's pairs end up in ascending expert order */
        int64_t *next = malloc(sizeof(int64_t) * (size_t)E);
        if (!next) {
            rc = -2;
            goto done;
        }
        memcpy(next, start, sizeof(int64_t) * (size_t)E);
        for (int64_t p = 0; p < P; p++) {
            const int64_t at = next[ids[p]]++;
            order[at] = p;
            where[p] = at;
        }
        free(next);
    }
    const int64_t gu_chunks = (2 * I + NR * CHUNK - 1) / (NR * CHUNK), down_chunks = (H + NR * CHUNK - 1) / (NR * CHUNK);
    const int64_t gu_panels = (2 * I + NR - 1) / NR, down_panels = (H + NR - 1) / NR;
    int nt = num_threads < 1 ? 1 : num_threads;
    if (P * (H + I) < 4096) nt = 1; /* a fork/join costs more than such a step */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (int64_t at = 0; at < P; at++) memcpy(rows + at * H, x + order[at] / topk * H, sizeof(float) * (size_t)H);
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < active * gu_chunks; item++) {
            const int64_t e = experts[item / gu_chunks], c = item % gu_chunks, n = start[e + 1] - start[e];
            const int64_t p0 = c * CHUNK, p1 = p0 + CHUNK < gu_panels ? p0 + CHUNK : gu_panels;
            qw_gemm_f32_panels(rows + start[e] * H, H, (const float *)(intptr_t)gate_up[e], gu + start[e] * 2 * I, 2 * I, n,
                               2 * I, H, p0, p1);
        }
#pragma omp for schedule(static)
        for (int64_t at = 0; at < P; at++) silu_row(gu + at * 2 * I, gu + at * 2 * I + I, act + at * I, (int)I);
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < active * down_chunks; item++) {
            const int64_t e = experts[item / down_chunks], c = item % down_chunks, n = start[e + 1] - start[e];
            const int64_t p0 = c * CHUNK, p1 = p0 + CHUNK < down_panels ? p0 + CHUNK : down_panels;
            qw_gemm_f32_panels(act + start[e] * I, I, (const float *)(intptr_t)down[e], rows + start[e] * H, H, n, H, I, p0, p1);
        }
        /* the weighted outputs, each product rounded and stored before any sum reads it (as the
         * grouped path's torch.mul, then index_add_: no fused multiply-add across the two) */
#pragma omp for schedule(static)
        for (int64_t at = 0; at < P; at++) {
            const float w = weights[order[at]];
            float *restrict r = rows + at * H;
            for (int64_t h = 0; h < H; h++) r[h] *= w;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            int64_t mine[64]; /* this token's sorted positions, ascending: its experts in ascending order */
            for (int64_t k = 0; k < topk; k++) {
                int64_t v = where[t * topk + k], j = k;
                while (j > 0 && mine[j - 1] > v) {
                    mine[j] = mine[j - 1];
                    j--;
                }
                mine[j] = v;
            }
            float *restrict o = out + t * H;
            for (int64_t h = 0; h < H; h++) o[h] = 0.0f;
            for (int64_t k = 0; k < topk; k++) {
                const float *restrict r = rows + mine[k] * H;
                for (int64_t h = 0; h < H; h++) o[h] += r[h];
            }
        }
    }
done:
    free(start);
    free(order);
    free(where);
    free(experts);
    free(rows);
    free(gu);
    free(act);
    return rc;
}
