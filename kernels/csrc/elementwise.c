/*
 * The CPU engine's per-layer elementwise work, one call each instead of the 2-15 small torch ops
 * it takes otherwise (at decode batch sizes each torch op costs ~10 us of dispatch for a few
 * microseconds of arithmetic, and a 30-layer model runs ~40 of them per layer per step).
 * fp32 activations, contiguous rows; the KV write also into an fp16 or a bf16 cache.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"
#include "rope.h"
#include "silu.h"
#include "wide.h"

/* Parallel from this many elements per call: below it a fork/join (~1-2 us with libgomp's
 * spinning pool) costs more than the second core saves. A decode step's norms (48 x 576) used
 * to run on one core while the other waited: ~2% of a 48-request fp32 run. */
#ifndef QW_PAR_ELEMS
#define QW_PAR_ELEMS (1 << 14)
#endif

/* out = weight * (h / sqrt(mean(h^2) + eps)) with h = x + residual (or x when residual is NULL);
 * h is written to new_residual. Rows of H floats; x, residual, new_residual, out: [T, H]. */
void qw_add_rms_norm_f32(const float *x, const float *residual, const float *weight,
                         float *new_residual, float *out, int64_t T, int H, float eps,
                         int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T * H >= QW_PAR_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict xr = x + t * H;
        float *restrict hr = new_residual + t * H;
        float *restrict o = out + t * H;
        float ss = 0.0f;
        if (residual) {
            const float *restrict rr = residual + t * H;
#pragma omp simd reduction(+ : ss)
            for (int i = 0; i < H; i++) {
                hr[i] = xr[i] + rr[i];
                ss += hr[i] * hr[i];
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int i = 0; i < H; i++) {
                hr[i] = xr[i];
                ss += xr[i] * xr[i];
            }
        }
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
        for (int i = 0; i < H; i++) o[i] = weight[i] * (hr[i] * inv);
    }
}

/* Rotary embedding, rotate-half convention, in place on q [T, Hq, D] and k [T, Hk, D] whose rows
 * (tokens) are row_stride floats apart (they are views into one fused qkv output) and whose heads
 * are D floats apart. cos/sin: [max_positions, D] tables, both halves equal. */
void qw_rope_f32(float *q, float *k, int64_t row_stride, const int64_t *positions, const float *cos_table,
                 const float *sin_table, int64_t T, int Hq, int Hk, int D, int num_threads) {
    const int half = D / 2;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T * (Hq + Hk) * D >= QW_PAR_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const float *restrict c = cos_table + positions[t] * D;
        const float *restrict s = sin_table + positions[t] * D;
        for (int h = 0; h < Hq + Hk; h++) {
            float *restrict x = h < Hq ? q + t * row_stride + (int64_t)h * D : k + t * row_stride + (int64_t)(h - Hq) * D;
#pragma omp simd
            for (int i = 0; i < half; i++) rope_pair(x[i], x[i + half], c, s, i, half, &x[i], &x[i + half]);
        }
    }
}

/* Every slot < num_slots (negative ones are padding): checked before anything is written. */
static int slots_in_range(const int64_t *slots, int64_t T, int64_t num_slots) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return 0;
    return 1;
}

/* Write key/value rows [T, HD] (rows key_stride / value_stride floats apart, HD = Hkv * D
 * contiguous floats each) to their slots of k_cache/v_cache [num_slots, HD]; a negative slot
 * is a padding token and is skipped. Returns -1, writing nothing, when a slot is out of range. */
int qw_store_kv_f32(const float *key, const float *value, int64_t key_stride, int64_t value_stride,
                    float *k_cache, float *v_cache, const int64_t *slots, int64_t T, int HD, int64_t num_slots) {
    if (!slots_in_range(slots, T, num_slots)) return -1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        memcpy(k_cache + slot * HD, key + t * key_stride, sizeof(float) * (size_t)HD);
        memcpy(v_cache + slot * HD, value + t * value_stride, sizeof(float) * (size_t)HD);
    }
    return 0;
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i]: the SwiGLU activation of a fused
 * gate/up projection [T, 2I]; out is [T, I]. silu(x) = x * sigmoid(x), with the exponential
 * always taken of a non-positive argument so that it cannot overflow. */
static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, int I) {
    for (int i = 0; i < I; i++) o[i] = silu_mul(g[i], u[i]);
}

/* One row of qw_silu_mul_f32 (gate g, up u), for kernels that run it inside their own parallel region. */
QW_WIDE void qw_silu_mul_f32_row(const float *g, const float *u, float *o, int I) { silu_mul_row(g, u, o, I); }

QW_WIDE void qw_silu_mul_f32(const float *gate_up, float *out, int64_t T, int I, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T * I >= QW_PAR_ELEMS)
    for (int64_t t = 0; t < T; t++) silu_mul_row(gate_up + t * 2 * I, gate_up + t * 2 * I + I, out + t * I, I);
}

/* qw_add_rms_norm_f32 for the CPU bf16 mode: x is a bf16 GEMM's output (x_bf16 != 0) or fp32, out
 * is bf16 (the next bf16 GEMM's input, rounded as torch's .to(torch.bfloat16) would); the residual
 * stream (residual, new_residual) and all the arithmetic stay fp32, so out equals
 * qw_add_rms_norm_f32 on x's fp32 values followed by that rounding. */
void qw_add_rms_norm_bf16out(const void *x, int x_bf16, const float *residual, const float *weight,
                             float *new_residual, uint16_t *out, int64_t T, int H, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T * H >= QW_PAR_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        float *restrict hr = new_residual + t * H;
        uint16_t *restrict o = out + t * H;
        if (x_bf16) {
            const uint16_t *restrict xr = (const uint16_t *)x + t * H;
            if (residual) {
                const float *restrict rr = residual + t * H;
#pragma omp simd
                for (int i = 0; i < H; i++) hr[i] = bf16_to_f32(xr[i]) + rr[i];
            } else {
#pragma omp simd
                for (int i = 0; i < H; i++) hr[i] = bf16_to_f32(xr[i]);
            }
        } else {
            const float *restrict xr = (const float *)x + t * H;
            if (residual) {
                const float *restrict rr = residual + t * H;
#pragma omp simd
                for (int i = 0; i < H; i++) hr[i] = xr[i] + rr[i];
            } else {
                memcpy(hr, xr, sizeof(float) * (size_t)H);
            }
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < H; i++) ss += hr[i] * hr[i];
        const float inv = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
        for (int i = 0; i < H; i++) o[i] = f32_to_bf16(weight[i] * (hr[i] * inv));
    }
}

/* qw_silu_mul_f32 on a bf16 gate_up [T, 2I] (a bf16 GEMM's output) into a bf16 out [T, I] (the
 * down projection's input): fp32 arithmetic, one rounding at the end. */
QW_WIDE void qw_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t T, int I, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (T * I >= QW_PAR_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *restrict g = gate_up + t * 2 * I, *restrict u = g + I;
        uint16_t *restrict o = out + t * I;
#pragma omp simd
        for (int i = 0; i < I; i++) o[i] = f32_to_bf16(silu_mul(bf16_to_f32(g[i]), bf16_to_f32(u[i])));
    }
}

/* qw_store_kv_f32 for a bf16 cache (the CPU engine's kv_cache_dtype="bfloat16"). */
QW_WIDE int qw_store_kv_bf16(const float *key, const float *value, int64_t key_stride, int64_t value_stride,
                     uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int64_t T, int HD, int64_t num_slots) {
    if (!slots_in_range(slots, T, num_slots)) return -1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const float *restrict k = key + t * key_stride, *restrict v = value + t * value_stride;
        uint16_t *restrict kd = k_cache + slot * HD, *restrict vd = v_cache + slot * HD;
#pragma omp simd
        for (int i = 0; i < HD; i++) {
            kd[i] = f32_to_bf16(k[i]);
            vd[i] = f32_to_bf16(v[i]);
        }
    }
    return 0;
}

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
/* qw_store_kv_f32 for an fp16 cache: rows rounded to nearest-even half precision (as torch's
 * .to(torch.float16)); HD must be a multiple of 8. */
int qw_store_kv_f16(const float *key, const float *value, int64_t key_stride, int64_t value_stride,
                    uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots, int64_t T, int HD, int64_t num_slots) {
    if (!slots_in_range(slots, T, num_slots)) return -1;
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const float *k = key + t * key_stride, *v = value + t * value_stride;
        uint16_t *kd = k_cache + slot * HD, *vd = v_cache + slot * HD;
        for (int i = 0; i < HD; i += 8) {
            _mm_storeu_si128((__m128i *)(kd + i), _mm256_cvtps_ph(_mm256_loadu_ps(k + i), _MM_FROUND_TO_NEAREST_INT));
            _mm_storeu_si128((__m128i *)(vd + i), _mm256_cvtps_ph(_mm256_loadu_ps(v + i), _MM_FROUND_TO_NEAREST_INT));
        }
    }
    return 0;
}
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* out[r] = argmax_j x[r * stride + j] for j < cols, as torch.argmax: the first index of the
 * maximum, or of the first NaN when the row holds one. The greedy sampler's [rows, vocab] argmax
 * (torch's reduction runs ~25x slower than a sum over the same logits on this CPU). x is fp32, or
 * bf16 (BF16 1: the bf16 model's logits, read as they are, half the bytes of an fp32 copy; each
 * value widens exactly, so the index is the fp32 copy's). */
static inline __attribute__((always_inline)) float argmax_at(const void *x, int64_t j, const int BF16) {
    return BF16 ? bf16_to_f32(((const uint16_t *)x)[j]) : ((const float *)x)[j];
}
#if defined(__AVX2__)
static inline __attribute__((always_inline)) __m256 argmax_load8(const void *x, int64_t j, const int BF16) {
    if (!BF16) return _mm256_loadu_ps((const float *)x + j);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + j));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

static inline __attribute__((always_inline)) int64_t argmax_row(const void *restrict x, int64_t cols, const int BF16) {
    int64_t j = 0, best = 0;
    float m = cols > 0 ? argmax_at(x, 0, BF16) : 0.0f;
    if (m != m) return 0;
#if defined(__AVX2__)
    if (cols >= 16) {
        __m256 vmax = argmax_load8(x, 0, BF16);
        __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = vidx;
        const __m256i step = _mm256_set1_epi32(8);
        __m256 nan = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
        for (j = 8; j + 8 <= cols && j + 8 <= INT32_MAX; j += 8) {
            cur = _mm256_add_epi32(cur, step);
            const __m256 v = argmax_load8(x, j, BF16);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ); /* strictly greater: earlier index wins ties */
            vmax = _mm256_blendv_ps(vmax, v, gt);
            vidx = _mm256_blendv_epi8(vidx, cur, _mm256_castps_si256(gt));
        }
        if (_mm256_movemask_ps(nan)) { /* a NaN somewhere before j: torch returns the first one */
            for (int64_t i = 0; i < j; i++)
                if (argmax_at(x, i, BF16) != argmax_at(x, i, BF16)) return i;
        }
        float mv[8];
        int32_t iv[8];
        _mm256_storeu_ps(mv, vmax);
        _mm256_storeu_si256((__m256i *)iv, vidx);
        m = mv[0];
        best = iv[0];
        for (int l = 1; l < 8; l++)
            if (mv[l] > m || (mv[l] == m && iv[l] < best)) { m = mv[l]; best = iv[l]; }
    }
#endif
    for (; j < cols; j++) {
        const float v = argmax_at(x, j, BF16);
        if (v != v) return j;
        if (v > m) { m = v; best = j; }
    }
    return best;
}

void qw_argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols >= (1 << 18))
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, cols, 0);
}

void qw_argmax_rows_bf16(const uint16_t *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * cols >= (1 << 18))
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, cols, 1);
}
