/*
 * The whole layer loop of a plain decoder (Llama's: norm -> qkv -> rotary -> KV write ->
 * attention -> o -> norm -> gate_up -> SwiGLU -> down, per layer) in one call, so that a decode
 * step pays one ctypes call instead of ~10 Python kernel wrappers per layer. At small decode
 * batches those wrappers cost more than the kernels: ~6.5 ms of a 25 ms batch-1 step on the
 * 2-vCPU AVX2 EPYC (docs/benchmarks.md), where the attention of a layer is ~10 us of work.
 *
 * Two forms, each calling exactly the kernels its Python loop calls, in the same order, with the
 * same arguments and thread count, so its results are bit for bit that loop's:
 *   qw_decoder_layers_f32   fp32 weights and activations (qworker/model/decoder.py forward)
 *   qw_decoder_layers_bf16  the CPU bf16 mode (_forward_cpu_bf16): bf16 weights, bf16 GEMM inputs
 *                           and outputs, an fp32 residual stream, fp32 rotary and attention; on AMX
 *                           the gate/up GEMM and SwiGLU are one call (csrc/gemm_amx.c, the same bits)
 * The GEMM comes in as a function pointer: the build whose micro-kernel runs (kernels/gemm_cpu.py
 * gemm_isa) need not be this library's.
 *
 * Buffers are the caller's (kernels/decoder_cpu.py); nothing here allocates. Rows are tokens:
 *   emb [T, H] fp32 (the embeddings, read by the first layer), res[2] [T, H] fp32 (the residual
 *   stream, ping-ponged so that no kernel reads and writes one buffer: after the last layer it is
 *   in res[1]), qkv [T, Q + 2 KV] fp32, attn [T, Q] fp32; h [T, H] (the o and down outputs; after
 *   the last layer the MLP's), x [T, H] (the norms' outputs), gu [T, 2 I], act [T, I]: fp32 in the
 *   fp32 form, bf16 in the bf16 form.
 * Returns 0; -1 when a slot is outside the cache, -2 when a block-table entry is (both before the
 * layer's cache is written); -3 when a kernel had no scratch memory or the cache dtype is not
 * built here (the caller then runs the Python loop, which falls back kernel by kernel).
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "rope.h"
#include "wide.h"

typedef int (*qw_gemm_fn)(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy,
                          int64_t M, int64_t N, int64_t K, int num_threads, int64_t mc, int64_t group, int64_t kc);
/* csrc/gemm_bf16.c's qw_gemm_bf16: bf16-packed weights; x, bias and y each fp32 or bf16 */
typedef int (*qw_gemm_bf16_fn)(const void *x, int64_t ldx, int x_bf16, const void *wp, const void *bias, int bias_bf16,
                               void *y, int64_t ldy, int y_bf16, int64_t M, int64_t N, int64_t K, int num_threads,
                               int64_t mc, int64_t group, int64_t kc);
/* csrc/gemm_amx.c's qw_gemm_bf16_amx_swiglu: act = silu(x Wg^T) * (x Wu^T), bit for bit the gate/up
 * GEMM's bf16 output followed by qw_silu_mul_bf16; -3 where it does not apply (then the two calls) */
typedef int (*qw_swiglu_fn)(const void *x, int64_t ldx, const void *wp, uint16_t *act, int64_t ldy, int64_t M,
                            int64_t I, int64_t K, int num_threads);

/* One layer's tensors: fp32 norms, the projections packed in panels (kernels/gemm_cpu.py; fp32 in
 * the fp32 form, bf16 in the bf16 form), their biases (fp32, or in the bf16 form fp32 or bf16 as
 * the flags say) and the layer's KV cache. */
typedef struct {
    const float *input_norm, *post_norm;
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *down;
    void *k_cache, *v_cache;
    int qkv_bias_bf16, o_bias_bf16;
} qw_layer;

/* One step: shapes, the per-step attention inputs every layer shares, and the scratch buffers. */
typedef struct {
    int64_t T;
    int H, Hq, Hkv, D, I;
    float eps, scale, softcap;
    int window, threads;
    int cache_dtype; /* 0 fp32, 1 fp16, 2 bf16 */
    int block_size;
    int64_t num_blocks;
    const int64_t *positions, *slots;
    const float *cos, *sin;
    const int32_t *tables, *seq_lens, *query_start_loc; /* query_start_loc: the extend rows', from 0 */
    int64_t table_stride;
    int num_decodes, num_seqs;
    void *gemm; /* qw_gemm_fn in the fp32 form, qw_gemm_bf16_fn in the bf16 form */
    const float *emb;
    float *res[2], *qkv, *attn;
    void *h, *x, *gu, *act;
    uint16_t *attn_bf16; /* the bf16 form's o input [T, Q] */
    int bf16_products;   /* a bf16 cache's attention multiplies in bf16 (csrc/paged_extend_bf16_products.c) */
    void *swiglu;        /* the bf16 form's gate/up GEMM with SwiGLU fused (qw_swiglu_fn), or NULL */
} qw_step;

/* the kernels of this library (elementwise.c, paged_decode.c, paged_extend.c) */
void qw_add_rms_norm_f32(const float *, const float *, const float *, float *, float *, int64_t, int, float, int);
void qw_rope_f32(float *, float *, int64_t, const int64_t *, const float *, const float *, int64_t, int, int, int, int);
void qw_silu_mul_f32(const float *, float *, int64_t, int, int);
void qw_add_rms_norm_bf16out(const void *, int, const float *, const float *, float *, uint16_t *, int64_t, int, float, int);
void qw_silu_mul_bf16(const uint16_t *, uint16_t *, int64_t, int, int);
typedef int (*store_fn)(const float *, const float *, int64_t, int64_t, void *, void *, const int64_t *, int64_t, int,
                        int64_t);
typedef int (*attn_decode_fn)(const float *, int64_t, const void *, const void *, const int32_t *, int64_t,
                              const int32_t *, float *, int64_t, int, int, int, int, int, float, int, int64_t, int, float,
                              const float *);
typedef int (*attn_extend_fn)(const float *, int64_t, const void *, const void *, const int32_t *, int64_t,
                              const int32_t *, const int32_t *, float *, int64_t, int, int, int, int, int, float, int,
                              int64_t, int, float, const float *);
#define DECLARE(dt)                                                                                                 \
    int qw_store_kv_##dt();                                                                                         \
    int qw_paged_decode_##dt();                                                                                     \
    int qw_paged_extend_##dt();
DECLARE(f32)
DECLARE(bf16)
int qw_paged_extend_bf16_products();
int qw_paged_decode_bf16_dp();
#if defined(__AVX2__) && defined(__F16C__) /* elementwise.c's fp16 KV write needs F16C */
DECLARE(f16)
#define QW_HAVE_F16_STORE 1
#endif

/* The KV write and attention kernels for the cache's dtype. */
typedef struct {
    store_fn store;
    attn_decode_fn decode;
    attn_extend_fn extend;
} cache_kernels;

static int cache_kernels_for(int dtype, cache_kernels *ck) {
    switch (dtype) {
    case 0:
        *ck = (cache_kernels){(store_fn)qw_store_kv_f32, (attn_decode_fn)qw_paged_decode_f32,
                              (attn_extend_fn)qw_paged_extend_f32};
        return 0;
#ifdef QW_HAVE_F16_STORE
    case 1:
        *ck = (cache_kernels){(store_fn)qw_store_kv_f16, (attn_decode_fn)qw_paged_decode_f16,
                              (attn_extend_fn)qw_paged_extend_f16};
        return 0;
#endif
    case 2:
        *ck = (cache_kernels){(store_fn)qw_store_kv_bf16, (attn_decode_fn)qw_paged_decode_bf16,
                              (attn_extend_fn)qw_paged_extend_bf16};
        return 0;
    default:
        return -3;
    }
}

/* Decode rows [0, num_decodes) with the decode kernel, the rest with the extend kernel (as
 * qworker/model/attention.py PagedAttention does). */
static int attention(const qw_step *s, const qw_layer *l, const cache_kernels *ck) {
    const int64_t qkv_row = (int64_t)(s->Hq + 2 * s->Hkv) * s->D, out_row = (int64_t)s->Hq * s->D;
    const int nd = s->num_decodes, rest = s->num_seqs - nd;
    if (nd > 0) {
        int rc = ck->decode(s->qkv, qkv_row, l->k_cache, l->v_cache, s->tables, s->table_stride, s->seq_lens, s->attn,
                            out_row, nd, s->Hq, s->Hkv, s->D, s->block_size, s->scale, s->threads, s->num_blocks,
                            s->window, s->softcap, NULL);
        if (rc != 0) return rc == -2 ? -2 : -3;
    }
    if (rest > 0 && s->T > nd) {
        int rc = ck->extend(s->qkv + nd * qkv_row, qkv_row, l->k_cache, l->v_cache, s->tables + nd * s->table_stride,
                            s->table_stride, s->query_start_loc, s->seq_lens + nd, s->attn + nd * out_row, out_row,
                            rest, s->Hq, s->Hkv, s->D, s->block_size, s->scale, s->threads, s->num_blocks, s->window,
                            s->softcap, NULL);
        if (rc != 0) return rc == -2 ? -2 : -3;
    }
    return 0;
}

/* What both forms check first: the cache dtype has kernels here, the decode rows fit the step. */
static int prepare(const qw_step *s, cache_kernels *ck) {
    if (cache_kernels_for(s->cache_dtype, ck) != 0) return -3;
    if (s->bf16_products && s->cache_dtype == 2) {
        ck->extend = (attn_extend_fn)qw_paged_extend_bf16_products;
        ck->decode = (attn_decode_fn)qw_paged_decode_bf16_dp;
    }
    if (s->num_decodes < 0 || s->num_decodes > s->T || s->num_decodes > s->num_seqs) return -3;
    return 0;
}

/* rotary on q and k in the qkv buffer, their K/V rows into the layer's cache, then attention */
static int rope_store_attend(const qw_step *s, const qw_layer *l, const cache_kernels *ck) {
    const int Q = s->Hq * s->D, KV = s->Hkv * s->D, W = Q + 2 * KV;
    float *q = s->qkv, *k = s->qkv + Q, *v = s->qkv + Q + KV;
    qw_rope_f32(q, k, W, s->positions, s->cos, s->sin, s->T, s->Hq, s->Hkv, s->D, s->threads);
    if (ck->store(k, v, W, W, l->k_cache, l->v_cache, s->slots, s->T, KV, s->num_blocks * s->block_size) != 0)
        return -1;
    return attention(s, l, ck);
}

int qw_decoder_layers_f32(const qw_layer *layers, int num_layers, const qw_step *s) {
    cache_kernels ck;
    if (prepare(s, &ck) != 0) return -3;
    const qw_gemm_fn gemm = (qw_gemm_fn)s->gemm;
    const int64_t T = s->T;
    const int H = s->H, Q = s->Hq * s->D, W = Q + 2 * s->Hkv * s->D, I = s->I, nt = s->threads;
    float *h = s->h, *x = s->x, *gu = s->gu, *act = s->act;
    const float *residual = 0; /* none before the first layer */
    for (int i = 0; i < num_layers; i++) {
        const qw_layer *l = &layers[i];
        qw_add_rms_norm_f32(i == 0 ? s->emb : h, residual, l->input_norm, s->res[0], x, T, H, s->eps, nt);
        if (gemm(x, H, l->qkv, l->qkv_bias, s->qkv, W, T, W, H, nt, 0, 0, 0) != 0) return -3;
        int rc = rope_store_attend(s, l, &ck);
        if (rc != 0) return rc;
        if (gemm(s->attn, Q, l->o, l->o_bias, h, H, T, H, Q, nt, 0, 0, 0) != 0) return -3;
        qw_add_rms_norm_f32(h, s->res[0], l->post_norm, s->res[1], x, T, H, s->eps, nt);
        if (gemm(x, H, l->gate_up, 0, gu, 2 * I, T, 2 * I, H, nt, 0, 0, 0) != 0) return -3;
        qw_silu_mul_f32(gu, act, T, I, nt);
        if (gemm(act, I, l->down, 0, h, H, T, H, I, nt, 0, 0, 0) != 0) return -3;
        residual = s->res[1];
    }
    return 0;
}

/* The bf16 form's rotary + KV write into a bf16 cache, one pass over the qkv rows instead of three
 * (round_to_bf16 on all of qkv, qw_rope_f32, qw_store_kv_bf16; ~2% of a 128-request bf16 run, the
 * KV write serial): each value rounded to bf16 as the qkv GEMM's bf16 output holds it, q and k
 * rotated by rope_pair as qw_rope_f32 does, q written back for attention, k and v written to their
 * slot of the cache (negative slots: padding, skipped). The same bits as the three calls (k and v
 * in the qkv buffer are left unrounded: nothing reads them there). Returns -1, writing nothing, when
 * a slot is outside the cache. */
QW_WIDE static int rope_store_bf16(const qw_step *s, const qw_layer *l) {
    const int D = s->D, half = D / 2, Hq = s->Hq, Hkv = s->Hkv, KV = Hkv * D, W = (Hq + 2 * Hkv) * D;
    const int64_t T = s->T, num_slots = s->num_blocks * s->block_size;
    for (int64_t t = 0; t < T; t++)
        if (s->slots[t] >= num_slots) return -1;
    uint16_t *k_cache = l->k_cache, *v_cache = l->v_cache;
#pragma omp parallel for num_threads(s->threads) schedule(static) if (T * W >= (1 << 14))
    for (int64_t t = 0; t < T; t++) {
        float *row = s->qkv + t * W;
        const float *restrict c = s->cos + s->positions[t] * D, *restrict sn = s->sin + s->positions[t] * D;
        const int64_t slot = s->slots[t];
        for (int h = 0; h < Hq; h++) {
            float *restrict x = row + h * D;
#pragma omp simd
            for (int i = 0; i < half; i++)
                rope_pair(bf16_to_f32(f32_to_bf16(x[i])), bf16_to_f32(f32_to_bf16(x[i + half])), c, sn, i, half, &x[i],
                          &x[i + half]);
        }
        if (slot < 0) continue;
        uint16_t *restrict kd = k_cache + slot * KV, *restrict vd = v_cache + slot * KV;
        for (int h = 0; h < Hkv; h++) {
            const float *restrict x = row + (Hq + h) * D;
            uint16_t *restrict o = kd + h * D;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float r1, r2;
                rope_pair(bf16_to_f32(f32_to_bf16(x[i])), bf16_to_f32(f32_to_bf16(x[i + half])), c, sn, i, half, &r1, &r2);
                o[i] = f32_to_bf16(r1);
                o[i + half] = f32_to_bf16(r2);
            }
        }
        const float *restrict v = row + Hq * D + KV;
#pragma omp simd
        for (int i = 0; i < KV; i++) vd[i] = f32_to_bf16(v[i]);
    }
    return 0;
}

/* fp32 values rounded to bf16 precision in place: what the Python loop's bf16 round trip gives
 * (NaN becomes 0x7fc0, not torch's vectorised 0xffff: the values are NaN either way, and the GEMMs
 * that read the bf16 ones below write every NaN as 0x7fc0, so nothing downstream differs) */
QW_WIDE static void round_to_bf16(float *v, int64_t n, int nt) {
#pragma omp parallel for simd num_threads(nt) schedule(static) if (n >= (1 << 14))
    for (int64_t i = 0; i < n; i++) v[i] = bf16_to_f32(f32_to_bf16(v[i]));
}

QW_WIDE static void to_bf16(const float *v, uint16_t *out, int64_t n, int nt) {
#pragma omp parallel for simd num_threads(nt) schedule(static) if (n >= (1 << 14))
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(v[i]);
}

/* The CPU bf16 mode's loop. qkv's bf16 output, which the Python loop widens back to fp32 for
 * rotary and attention, is written in fp32 and rounded in place (the same values: the GEMM rounds
 * its fp32 sums once either way); the attention output is rounded into a bf16 o input, as the
 * Python loop's .to(torch.bfloat16) does (the GEMM may take another path for fp32 x, see
 * csrc/gemm_bf16.c's dot-product kernel). */
int qw_decoder_layers_bf16(const qw_layer *layers, int num_layers, const qw_step *s) {
    cache_kernels ck;
    if (prepare(s, &ck) != 0) return -3;
    const qw_gemm_bf16_fn gemm = (qw_gemm_bf16_fn)s->gemm;
    const int64_t T = s->T;
    const int H = s->H, Q = s->Hq * s->D, W = Q + 2 * s->Hkv * s->D, I = s->I, nt = s->threads;
    uint16_t *h = s->h, *x = s->x, *gu = s->gu, *act = s->act;
    const float *residual = 0;
    for (int i = 0; i < num_layers; i++) {
        const qw_layer *l = &layers[i];
        qw_add_rms_norm_bf16out(i == 0 ? (const void *)s->emb : h, i > 0, residual, l->input_norm, s->res[0], x, T, H,
                                s->eps, nt);
        if (gemm(x, H, 1, l->qkv, l->qkv_bias, l->qkv_bias_bf16, s->qkv, W, 0, T, W, H, nt, 0, 0, 0) != 0) return -3;
        int rc;
        if (s->cache_dtype == 2) { /* bf16 cache: rounding, rotary and the KV write in one pass */
            if (rope_store_bf16(s, l) != 0) return -1;
            rc = attention(s, l, &ck);
        } else {
            round_to_bf16(s->qkv, T * W, nt);
            rc = rope_store_attend(s, l, &ck);
        }
        if (rc != 0) return rc;
        to_bf16(s->attn, s->attn_bf16, T * Q, nt);
        if (gemm(s->attn_bf16, Q, 1, l->o, l->o_bias, l->o_bias_bf16, h, H, 1, T, H, Q, nt, 0, 0, 0) != 0) return -3;
        qw_add_rms_norm_bf16out(h, 1, s->res[0], l->post_norm, s->res[1], x, T, H, s->eps, nt);
        const int fused = s->swiglu ? ((qw_swiglu_fn)s->swiglu)(x, H, l->gate_up, act, I, T, I, H, nt) : -3;
        if (fused == -3) {
            if (gemm(x, H, 1, l->gate_up, 0, 0, gu, 2 * I, 1, T, 2 * I, H, nt, 0, 0, 0) != 0) return -3;
            qw_silu_mul_bf16(gu, act, T, I, nt);
        } else if (fused != 0) {
            return -3;
        }
        if (gemm(act, I, 1, l->down, 0, 0, h, H, 1, T, H, I, nt, 0, 0, 0) != 0) return -3;
        residual = s->res[1];
    }
    return 0;
}
