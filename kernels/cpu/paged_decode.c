/*
 * Paged decode attention for the CPU engine: one query token per sequence against its K/V,
 * read in place through the block table (no gathered copy of the context).
 *
 * Layout (the same as every kernel in this package, see kernels/reference.py):
 *   q            [B, Hq, D]                          row b at q + b * q_stride
 *   k/v cache    [num_blocks, block_size, Hkv, D]    contiguous
 *   block_tables [B, max_blocks] int32               row b at block_tables + b * table_stride
 *   seq_lens     [B] int32                           context length, query at position len - 1
 *   out          [B, Hq, D]                          row b at out + b * out_stride
 * GQA: query head g * G .. reads KV head h = g / G, G = Hq / Hkv; K/V are never repeated.
 *
 * Work is split over (sequence, KV head) pairs, each done by one thread: the G query heads of a
 * KV head share every K/V row they load. Two passes over the context: scores (q . k) for all G
 * heads, a softmax, then the weighted sum of V rows. Everything is fp32.
 *
 * Built by kernels/cpu.py with -O3 -march=native -fopenmp and loaded with ctypes. libgomp is the
 * same library torch loaded (same soname), so this code and torch share one OpenMP thread pool.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* exp(x) for x <= 0 (softmax arguments after subtracting the max), ~1 ulp-level accuracy in the
 * range that matters, written with plain arithmetic so that the compiler vectorises the loop that
 * calls it (libm's expf is only vectorised under -ffast-math, which we avoid because it changes
 * the floating-point environment of the whole process). */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;                 /* e^-87 ~ 1.6e-38: still a normal float */
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float k = __builtin_floorf(x * log2e + 0.5f);
    float r = x - k * ln2_hi - k * ln2_lo;       /* |r| <= ln2 / 2 */
    /* minimax polynomial for e^r on [-ln2/2, ln2/2] (Cephes expf coefficients) */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale2k;
    scale2k.i = ((int32_t)k + 127) << 23;       /* 2^k, k in [-126, 0] */
    return p * scale2k.f;
}

/* scores[t] = scale * q . k_t for n <= 8 consecutive tokens of one block (k rows token_stride
 * apart). D is a multiple of 8. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline void score_tokens(const float *restrict q, const float *restrict k, int64_t token_stride,
                                int n, int D, float scale, float *restrict scores) {
    __m256 r[8];
    for (int t = 0; t < 8; t++) {
        if (t >= n) { r[t] = _mm256_setzero_ps(); continue; }
        const float *kt = k + t * token_stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        int d = 0;
        for (; d + 16 <= D; d += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kt + d), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(kt + d + 8), a1);
        }
        if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kt + d), a0);
        r[t] = _mm256_add_ps(a0, a1);
    }
    /* transpose-and-add: lane t of the result is the sum of r[t]'s lanes */
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(r[4], r[5]), _mm256_hadd_ps(r[6], r[7]));
    __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
    sums = _mm256_mul_ps(sums, _mm256_set1_ps(scale));
    if (n == 8) {
        _mm256_storeu_ps(scores, sums);
    } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, sums);
        for (int t = 0; t < n; t++) scores[t] = tmp[t];
    }
}
#else
static inline void score_tokens(const float *restrict q, const float *restrict k, int64_t token_stride,
                                int n, int D, float scale, float *restrict scores) {
    for (int t = 0; t < n; t++) {
        const float *restrict kt = k + t * token_stride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; d++) dot += q[d] * kt[d];
        scores[t] = dot * scale;
    }
}
#endif

static void attend_one(const float *restrict qh, const float *restrict k_cache,
                       const float *restrict v_cache, const int32_t *restrict table, int len,
                       int block_size, int64_t token_stride, int head_offset, int G, int D,
                       float scale, float *restrict scores, float *restrict acc,
                       float *restrict outh) {
    /* pass 1: scores[g * len + t] = scale * q_g . k_t */
    for (int t0 = 0, i = 0; t0 < len; t0 += block_size, i++) {
        const float *k = k_cache + (int64_t)table[i] * block_size * token_stride + head_offset;
        const int n = len - t0 < block_size ? len - t0 : block_size;
        for (int g = 0; g < G; g++)
            for (int j = 0; j < n; j += 8)
                score_tokens(qh + (int64_t)g * D, k + j * token_stride, token_stride,
                             n - j < 8 ? n - j : 8, D, scale, scores + (int64_t)g * len + t0 + j);
    }
    /* softmax numerators in place; the 1/sum is applied once at the end */
    float inv_sum[G];
    for (int g = 0; g < G; g++) {
        float *restrict s = scores + (int64_t)g * len;
        float m = s[0];
#pragma omp simd reduction(max : m)
        for (int t = 0; t < len; t++) m = s[t] > m ? s[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; t++) {
            s[t] = exp_nonpositive(s[t] - m);
            sum += s[t];
        }
        inv_sum[g] = 1.0f / sum;
    }
    /* pass 2: acc_g = sum_t p[g, t] * v_t, one query head at a time so that its accumulator
     * row stays in registers; the V rows come from L1/L2 after the first head */
    for (int g = 0; g < G; g++) {
        float *restrict a = acc;
        const float *restrict p = scores + (int64_t)g * len;
        memset(a, 0, sizeof(float) * (size_t)D);
        for (int t0 = 0, i = 0; t0 < len; t0 += block_size, i++) {
            const float *restrict v = v_cache + (int64_t)table[i] * block_size * token_stride + head_offset;
            const int n = len - t0 < block_size ? len - t0 : block_size;
            for (int j = 0; j < n; j++) {
                const float pj = p[t0 + j];
                const float *restrict vj = v + j * token_stride;
#pragma omp simd
                for (int d = 0; d < D; d++) a[d] += pj * vj[d];
            }
        }
        float *restrict o = outh + (int64_t)g * D;
        for (int d = 0; d < D; d++) o[d] = a[d] * inv_sum[g];
    }
}

/* Returns 0, or -1 when a thread could not allocate its scratch (the caller falls back). */
int qw_paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache,
                        const float *v_cache, const int32_t *block_tables, int64_t table_stride,
                        const int32_t *seq_lens, float *out, int64_t out_stride, int B, int Hq,
                        int Hkv, int D, int block_size, float scale, int num_threads) {
    const int G = Hq / Hkv;
    const int64_t token_stride = (int64_t)Hkv * D;
    int max_len = 1;
    for (int b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        /* per thread: G x max_len scores and G x D accumulators */
        float *scratch = malloc(sizeof(float) * ((size_t)G * max_len + (size_t)G * D));
        if (!scratch) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)B * Hkv; item++) {
            if (!scratch) continue;
            const int b = (int)(item / Hkv), h = (int)(item % Hkv);
            const int len = seq_lens[b];
            float *outh = out + b * out_stride + (int64_t)h * G * D;
            if (len <= 0) {
                memset(outh, 0, sizeof(float) * (size_t)G * D);
                continue;
            }
            attend_one(q + b * q_stride + (int64_t)h * G * D, k_cache, v_cache,
                       block_tables + b * table_stride, len, block_size, token_stride, h * D, G, D,
                       scale, scratch, scratch + (size_t)G * max_len, outh);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
