/*
 * The whole layer loop of a plain fp32 decoder (Llama's: norm -> qkv -> rotary -> KV write ->
 * attention -> o -> norm -> gate_up -> SwiGLU -> down, per layer) in one call, so that a decode
 * step pays one ctypes call instead of ~10 Python kernel wrappers per layer. At small decode
 * batches those wrappers cost more than the kernels: ~6.5 ms of a 25 ms batch-1 step on the
 * 2-vCPU AVX2 EPYC (docs/benchmarks.md), where the attention of a layer is ~10 us of work.
 *
 * It calls exactly the kernels the Python loop (qworker/model/decoder.py DecoderModel.forward)
 * calls, in the same order, with the same arguments and thread count, so its results are bit for
 * bit the Python loop's. The GEMM comes in as a function pointer: the build whose micro-kernel
 * runs (kernels/gemm_cpu.py gemm_isa) need not be this library's.
 *
 * Buffers are the caller's (kernels/decoder_cpu.py); nothing here allocates. Rows are tokens:
 *   h [T, H] (in: the embeddings; out: the last layer's MLP output), res[2] [T, H] (the residual
 *   stream, ping-ponged so that no kernel reads and writes one buffer: after the last layer it is
 *   in res[1]), x [T, H], qkv [T, Q + 2 KV], attn [T, Q], gu [T, 2 I], act [T, I].
 * Returns 0; -1 when a slot is outside the cache, -2 when a block-table entry is (both before the
 * layer's cache is written); -3 when a kernel had no scratch memory or the cache dtype is not
 * built here (the caller then runs the Python loop, which falls back kernel by kernel).
 */
#include <stdint.h>

typedef int (*qw_gemm_fn)(const float *x, int64_t ldx, const float *wp, const float *bias, float *y, int64_t ldy,
                          int64_t M, int64_t N, int64_t K, int num_threads, int64_t mc, int64_t group, int64_t kc);

/* One layer's tensors (packed panels for the projections, see kernels/gemm_cpu.py). */
typedef struct {
    const float *input_norm, *post_norm;
    const float *qkv, *qkv_bias, *o, *o_bias, *gate_up, *down;
    void *k_cache, *v_cache;
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
    qw_gemm_fn gemm;
    float *h, *res[2], *x, *qkv, *attn, *gu, *act;
} qw_step;

/* the kernels of this library (elementwise.c, paged_decode.c, paged_extend.c) */
void qw_add_rms_norm_f32(const float *, const float *, const float *, float *, float *, int64_t, int, float, int);
void qw_rope_f32(float *, float *, int64_t, const int64_t *, const float *, const float *, int64_t, int, int, int, int);
void qw_silu_mul_f32(const float *, float *, int64_t, int, int);
typedef int (*store_fn)(const float *, const float *, int64_t, int64_t, void *, void *, const int64_t *, int64_t, int,
                        int64_t);
typedef int (*attn_decode_fn)(const float *, int64_t, const void *, const void *, const int32_t *, int64_t,
                              const int32_t *, float *, int64_t, int, int, int, int, int, float, int, int64_t, int, float);
typedef int (*attn_extend_fn)(const float *, int64_t, const void *, const void *, const int32_t *, int64_t,
                              const int32_t *, const int32_t *, float *, int64_t, int, int, int, int, int, float, int,
                              int64_t, int, float);
#define DECLARE(dt)                                                                                                 \
    int qw_store_kv_##dt();                                                                                         \
    int qw_paged_decode_##dt();                                                                                     \
    int qw_paged_extend_##dt();
DECLARE(f32)
DECLARE(bf16)
#if defined(__AVX2__) && defined(__F16C__) /* elementwise.c's fp16 KV write needs F16C */
DECLARE(f16)
#define QW_HAVE_F16_STORE 1
#endif

static int cache_kernels(int dtype, store_fn *store, attn_decode_fn *decode, attn_extend_fn *extend) {
    switch (dtype) {
    case 0:
        *store = (store_fn)qw_store_kv_f32, *decode = (attn_decode_fn)qw_paged_decode_f32;
        *extend = (attn_extend_fn)qw_paged_extend_f32;
        return 0;
#ifdef QW_HAVE_F16_STORE
    case 1:
        *store = (store_fn)qw_store_kv_f16, *decode = (attn_decode_fn)qw_paged_decode_f16;
        *extend = (attn_extend_fn)qw_paged_extend_f16;
        return 0;
#endif
    case 2:
        *store = (store_fn)qw_store_kv_bf16, *decode = (attn_decode_fn)qw_paged_decode_bf16;
        *extend = (attn_extend_fn)qw_paged_extend_bf16;
        return 0;
    default:
        return -3;
    }
}

/* Decode rows [0, num_decodes) with the decode kernel, the rest with the extend kernel (as
 * qworker/model/attention.py PagedAttention does). */
static int attention(const qw_step *s, const qw_layer *l, attn_decode_fn decode, attn_extend_fn extend) {
    const int64_t qkv_row = (int64_t)(s->Hq + 2 * s->Hkv) * s->D, out_row = (int64_t)s->Hq * s->D;
    const int nd = s->num_decodes, rest = s->num_seqs - nd;
    if (nd > 0) {
        int rc = decode(s->qkv, qkv_row, l->k_cache, l->v_cache, s->tables, s->table_stride, s->seq_lens, s->attn,
                        out_row, nd, s->Hq, s->Hkv, s->D, s->block_size, s->scale, s->threads, s->num_blocks,
                        s->window, s->softcap);
        if (rc != 0) return rc == -2 ? -2 : -3;
    }
    if (rest > 0 && s->T > nd) {
        int rc = extend(s->qkv + nd * qkv_row, qkv_row, l->k_cache, l->v_cache, s->tables + nd * s->table_stride,
                        s->table_stride, s->query_start_loc, s->seq_lens + nd, s->attn + nd * out_row, out_row, rest,
                        s->Hq, s->Hkv, s->D, s->block_size, s->scale, s->threads, s->num_blocks, s->window,
                        s->softcap);
        if (rc != 0) return rc == -2 ? -2 : -3;
    }
    return 0;
}

int qw_decoder_layers_f32(const qw_layer *layers, int num_layers, const qw_step *s) {
    store_fn store;
    attn_decode_fn decode;
    attn_extend_fn extend;
    if (cache_kernels(s->cache_dtype, &store, &decode, &extend) != 0) return -3;
    if (s->num_decodes < 0 || s->num_decodes > s->T || s->num_decodes > s->num_seqs) return -3;
    const int64_t T = s->T;
    const int H = s->H, Q = s->Hq * s->D, KV = s->Hkv * s->D, W = Q + 2 * KV, I = s->I;
    const int64_t num_slots = s->num_blocks * s->block_size;
    const float *residual = 0; /* none before the first layer */
    for (int i = 0; i < num_layers; i++) {
        const qw_layer *l = &layers[i];
        qw_add_rms_norm_f32(s->h, residual, l->input_norm, s->res[0], s->x, T, H, s->eps, s->threads);
        if (s->gemm(s->x, H, l->qkv, l->qkv_bias, s->qkv, W, T, W, H, s->threads, 0, 0, 0) != 0) return -3;
        float *q = s->qkv, *k = s->qkv + Q, *v = s->qkv + Q + KV;
        qw_rope_f32(q, k, W, s->positions, s->cos, s->sin, T, s->Hq, s->Hkv, s->D, s->threads);
        if (store(k, v, W, W, l->k_cache, l->v_cache, s->slots, T, KV, num_slots) != 0) return -1;
        int rc = attention(s, l, decode, extend);
        if (rc != 0) return rc;
        if (s->gemm(s->attn, Q, l->o, l->o_bias, s->h, H, T, H, Q, s->threads, 0, 0, 0) != 0) return -3;
        qw_add_rms_norm_f32(s->h, s->res[0], l->post_norm, s->res[1], s->x, T, H, s->eps, s->threads);
        if (s->gemm(s->x, H, l->gate_up, 0, s->gu, 2 * I, T, 2 * I, H, s->threads, 0, 0, 0) != 0) return -3;
        qw_silu_mul_f32(s->gu, s->act, T, I, s->threads);
        if (s->gemm(s->act, I, l->down, 0, s->h, H, T, H, I, s->threads, 0, 0, 0) != 0) return -3;
        residual = s->res[1];
    }
    return 0;
}
