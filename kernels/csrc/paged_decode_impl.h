/* The body of paged_decode.c, instantiated once per cache element type. Expects:
 *   KV_T       the cache element type (float, or uint16_t holding IEEE fp16)
 *   LOAD8(p)   8 cache elements at p as an __m256 of floats (AVX builds)
 *   LOAD1(p)   one cache element at p as a float
 *   FN(name)   name with the type's suffix, so the two copies do not collide
 */
#ifdef QW_AVX

/* scores[t] = scale * q . k_t for n <= 8 consecutive tokens (k rows token_stride apart);
 * D is a multiple of 8. The 8 tokens' dot products run interleaved, one accumulator each, so
 * that 8 independent FMA chains hide the FMA latency and each q vector is loaded once for all 8
 * (one token at a time, the 4-deep chains of a 64-wide dot product left the FMA units idle most
 * of the time). Tokens past n re-read row n - 1 (valid memory); their sums are dropped. */
static inline void FN(score_tokens)(const float *restrict q, const KV_T *restrict k, int64_t token_stride,
                                int n, int D, float scale, float *restrict scores) {
    __m256 r[8];
    const KV_T *kt[8];
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) {
        r[t] = _mm256_setzero_ps();
        kt[t] = k + (t < n ? t : n - 1) * token_stride;
    }
    for (int d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) r[t] = _mm256_fmadd_ps(qd, LOAD8(kt[t] + d), r[t]);
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

/* acc[0:D] += sum_{j<n} p[j] * v_j (v rows token_stride apart), with the accumulator in
 * registers for the block (ND = D / 8 vectors, a compile-time constant after inlining). */
static inline void FN(accumulate_fixed)(const float *restrict p, const KV_T *restrict v, int n,
                                    int64_t token_stride, float *restrict acc, const int ND) {
    __m256 a[16];
#pragma GCC unroll 16
    for (int i = 0; i < ND; i++) a[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int j = 0; j < n; j++, v += token_stride) {
        const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 16
        for (int i = 0; i < ND; i++) a[i] = _mm256_fmadd_ps(pj, LOAD8(v + 8 * i), a[i]);
    }
#pragma GCC unroll 16
    for (int i = 0; i < ND; i++) _mm256_storeu_ps(acc + 8 * i, a[i]);
}
#ifdef QW_AVX512
/* score_tokens with 16-float vectors for up to 16 tokens (D a multiple of 16): 16 independent FMA
 * chains; each accumulator is folded to 8 lanes and the two groups of 8 go through the same
 * transpose-and-add as the 8-wide version. */
static inline void FN(score_tokens16)(const float *restrict q, const KV_T *restrict k, int64_t token_stride,
                                  int n, int D, float scale, float *restrict scores) {
    __m512 r[16];
    const KV_T *kt[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) {
        r[t] = _mm512_setzero_ps();
        kt[t] = k + (t < n ? t : n - 1) * token_stride;
    }
    for (int d = 0; d < D; d += 16) {
        const __m512 qd = _mm512_loadu_ps(q + d);
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) r[t] = _mm512_fmadd_ps(qd, LOAD16(kt[t] + d), r[t]);
    }
    __m256 h[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) h[t] = qw_half_sum(r[t]);
    const __m256 vs = _mm256_set1_ps(scale);
    const __m256 lo = _mm256_mul_ps(qw_fold8(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]), vs);
    const __m256 hi = _mm256_mul_ps(qw_fold8(h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]), vs);
    if (n == 16) {
        _mm256_storeu_ps(scores, lo);
        _mm256_storeu_ps(scores + 8, hi);
    } else {
        float tmp[16];
        _mm256_storeu_ps(tmp, lo);
        _mm256_storeu_ps(tmp + 8, hi);
        for (int t = 0; t < n; t++) scores[t] = tmp[t];
    }
}

/* accumulate_fixed with ND16 = D / 16 16-float vectors */
static inline void FN(accumulate16_fixed)(const float *restrict p, const KV_T *restrict v, int n,
                                      int64_t token_stride, float *restrict acc, const int ND16) {
    __m512 a[8];
#pragma GCC unroll 8
    for (int i = 0; i < ND16; i++) a[i] = _mm512_loadu_ps(acc + 16 * i);
    for (int j = 0; j < n; j++, v += token_stride) {
        const __m512 pj = _mm512_set1_ps(p[j]);
#pragma GCC unroll 8
        for (int i = 0; i < ND16; i++) a[i] = _mm512_fmadd_ps(pj, LOAD16(v + 16 * i), a[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < ND16; i++) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#endif
#else
static inline void FN(score_tokens)(const float *restrict q, const KV_T *restrict k, int64_t token_stride,
                                int n, int D, float scale, float *restrict scores) {
    for (int t = 0; t < n; t++) {
        const KV_T *restrict kt = k + t * token_stride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; d++) dot += q[d] * LOAD1(kt + d);
        scores[t] = dot * scale;
    }
}
#endif

static inline void FN(accumulate)(const float *restrict p, const KV_T *restrict v, int n, int64_t token_stride,
                              int D, float *restrict acc) {
#ifdef QW_AVX512
    if (D == 64) { FN(accumulate16_fixed)(p, v, n, token_stride, acc, 4); return; }
    if (D == 128) { FN(accumulate16_fixed)(p, v, n, token_stride, acc, 8); return; }
#endif
#ifdef QW_AVX
    if (D == 64) { FN(accumulate_fixed)(p, v, n, token_stride, acc, 8); return; }
    if (D == 128) { FN(accumulate_fixed)(p, v, n, token_stride, acc, 16); return; }
#endif
    for (int j = 0; j < n; j++) {
        const KV_T *restrict vj = v + j * token_stride;
#pragma omp simd
        for (int d = 0; d < D; d++) acc[d] += p[j] * LOAD1(vj + d);
    }
}

/* Tokens [c, ce) of a page (a run), the columns of KV heads [h0, h1): touched in address order
 * before they are computed head by head (qw_touch_rows says why). */
static inline void FN(touch_chunk)(const KV_T *page, int c, int ce, int64_t token_stride, int h0, int h1, int D) {
    qw_touch_rows(page + c * token_stride + (int64_t)h0 * D, ce - c, token_stride * (int64_t)sizeof(KV_T),
                  (int64_t)(h1 - h0) * D * (int64_t)sizeof(KV_T));
}

/* One sequence, KV heads [h0, h1): nq = (h1 - h0) * G query heads, over tokens [lo, len) (lo > 0
 * under a sliding window: the pages before the one holding lo are never touched, and the tokens
 * before lo in that page are skipped). softcap > 0 caps the scores (softcap * tanh(s / softcap)).
 * scores: nq x (len - lo) scratch; acc: nq x D scratch; qs/outs: the first query head's row. */
static inline __attribute__((always_inline)) void FN(attend_body)(QW_ATTEND_PARAMS, const int stream) {
    const int nq = (h1 - h0) * G;
    const int span = len - lo;
    const int num_blks = (len + block_size - 1) / block_size;
    const int blk0 = lo / block_size;
    qw_stream ahead = qw_stream_start(k_cache, v_cache, table, block_size, token_stride, h0, h1, D, sizeof(KV_T), lo, span);
    /* pass 1: scores[qh * span + t - lo] = scale * q_qh . k_t, page by page */
    for (int blk = blk0, run; blk < num_blks; blk += run) {
        run = qw_run_length(table, blk, num_blks);
        const int t0 = blk * block_size;
        const KV_T *page = k_cache + (int64_t)table[blk] * block_size * token_stride;
        const int n = len - t0 < run * block_size ? len - t0 : run * block_size;
        /* c starts past 0 only in a sliding window's first page */
        for (int c = lo > t0 ? lo - t0 : 0, ce; c < n; c = ce) {
            ce = c + QW_PLAIN_CHUNK < n ? c + QW_PLAIN_CHUNK : n;
            if (stream) qw_stream_to(&ahead, t0 + ce - lo);
            FN(touch_chunk)(page, c, ce, token_stride, h0, h1, D);
            for (int h = h0; h < h1; h++) {
                const KV_T *k = page + (int64_t)h * D;
                for (int g = 0; g < G; g++) {
                    const int qh = (h - h0) * G + g;
                    float *s = scores + (int64_t)qh * span + (t0 - lo);
#ifdef QW_AVX512
                    if (D % 16 == 0) {
                        for (int j = c; j < ce; j += 16)
                            FN(score_tokens16)(qs + (int64_t)qh * D, k + j * token_stride, token_stride,
                                               ce - j < 16 ? ce - j : 16, D, scale, s + j);
                        continue;
                    }
#endif
                    for (int j = c; j < ce; j += 8)
                        FN(score_tokens)(qs + (int64_t)qh * D, k + j * token_stride, token_stride,
                                         ce - j < 8 ? ce - j : 8, D, scale, s + j);
                }
            }
        }
    }
    /* softmax numerators in place; the 1/sum is applied once at the end */
    float inv_sum[nq];
    for (int qh = 0; qh < nq; qh++) inv_sum[qh] = qw_softmax_numerators(scores + (int64_t)qh * span, span, softcap, QW_SINK(qh), NULL);
    /* pass 2: acc_qh = sum_t p[qh, t] * v_t, page by page */
    memset(acc, 0, sizeof(float) * (size_t)nq * D);
    for (int blk = blk0, run; blk < num_blks; blk += run) {
        run = qw_run_length(table, blk, num_blks);
        const int t0 = blk * block_size;
        const KV_T *page = v_cache + (int64_t)table[blk] * block_size * token_stride;
        const int n = len - t0 < run * block_size ? len - t0 : run * block_size;
        for (int c = lo > t0 ? lo - t0 : 0, ce; c < n; c = ce) {
            ce = c + QW_V_CHUNK < n ? c + QW_V_CHUNK : n;
            if (stream) qw_stream_to(&ahead, span + t0 + ce - lo);
            FN(touch_chunk)(page, c, ce, token_stride, h0, h1, D);
            for (int h = h0; h < h1; h++) {
                const KV_T *v = page + c * token_stride + (int64_t)h * D;
                for (int g = 0; g < G; g++) {
                    const int qh = (h - h0) * G + g;
                    FN(accumulate)(scores + (int64_t)qh * span + (t0 - lo) + c, v, ce - c, token_stride, D,
                                   acc + (int64_t)qh * D);
                }
            }
        }
    }
    for (int qh = 0; qh < nq; qh++)
        for (int d = 0; d < D; d++) outs[(int64_t)qh * D + d] = acc[(int64_t)qh * D + d] * inv_sum[qh];
}

/* attend_body without and with qw_stream, chosen per item: a sequence whose attended pages are
 * one run is the hardware prefetcher's; scattered ones take the stream (decode attention 0.6-0.8x
 * the time on shuffled pages, Zen 4). The stream's copy on one run measured ~5% slower (fp32)
 * even with nothing to ask for, and ~20% slower asking for every row. */
static void FN(attend)(QW_ATTEND_PARAMS) { FN(attend_body)(QW_ATTEND_ARGS, 0); }
static void FN(attend_streamed)(QW_ATTEND_PARAMS) { FN(attend_body)(QW_ATTEND_ARGS, 1); }

#ifdef QW_AVX512
/* The GQA score kernels' start: the 8 tokens' rows (tokens past n re-read row n - 1, valid
 * memory; their sums are dropped) and NH heads' zeroed accumulators. */
static inline __attribute__((always_inline)) void FN(score8_start)(const KV_T *k, int64_t token_stride, int n,
                                                                 const int NH, const KV_T *kt[8], __m512 r[3][8]) {
#pragma GCC unroll 8
    for (int t = 0; t < 8; t++) kt[t] = k + (t < n ? t : n - 1) * token_stride;
#pragma GCC unroll 3
    for (int g = 0; g < NH; g++)
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) r[g][t] = _mm512_setzero_ps();
}
#endif

#if defined(QW_AVX512) && defined(QW_DP)
/* The GQA kernels with their two products in bf16 (VDPBF16PS: two bf16 products summed into an
 * fp32 lane per instruction, no conversion of the cache's rows): the bf16 mode's decode
 * (qw_paged_decode_bf16_dp). q arrives scaled and rounded to bf16 (qs_bf), in natural channel
 * order: each 64-byte K load holds the same 32 channels as the q load it meets, so a score is
 * q_bf . k_t directly (the 8-token transpose-and-add as in score8_heads). */
static inline __attribute__((always_inline)) void FN(score8_heads_dp)(const uint16_t *restrict q, const KV_T *restrict k,
                                                                    int64_t token_stride, int n, const int ND16,
                                                                    const int NH, float *restrict s, int64_t s_stride) {
    __m512 r[3][8];
    const KV_T *kt[8];
    FN(score8_start)(k, token_stride, n, NH, kt, r);
#pragma GCC unroll 4
    for (int i = 0; i < ND16 / 2; i++) {
        __m512bh qv[3];
#pragma GCC unroll 3
        for (int g = 0; g < NH; g++) qv[g] = (__m512bh)_mm512_loadu_si512((const void *)(q + (int64_t)g * ND16 * 16 + 32 * i));
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512((const void *)(kt[t] + 32 * i));
#pragma GCC unroll 3
            for (int g = 0; g < NH; g++) r[g][t] = _mm512_dpbf16_ps(r[g][t], qv[g], kv);
        }
    }
    qw_store_scores8(r, NH, n, 1.0f, s, s_stride); /* q came scaled: times 1 is exact */
}

/* acc[g] += sum_{j<n} p[g][j] * v_j for NH query heads, p already rounded to bf16 (exactly
 * representable: the bits are its upper half). Tokens go in pairs: the rows of j and j + 1
 * interleaved 16 bits at a time (unpacklo/hi within each 128-bit lane) meet the broadcast pair
 * (p_j, p_j+1); an odd last token pairs with zeros (so does every token when pairs is 0). The
 * caller starts each call at an even token position, so the pairs are (2m, 2m + 1) by position
 * whatever the pages' layout (one VDPBF16PS adds both products in one rounding: another pairing
 * would give other bits). The accumulators hold the channels in the unpack order (qw_dp_join puts
 * them back). */
static inline __attribute__((always_inline)) void FN(acc_heads_dp)(const float *restrict p, int64_t p_stride,
                                                                 const KV_T *restrict v, int64_t token_stride, int n,
                                                                 const int ND16, const int NH, int pairs,
                                                                 float *restrict acc) {
    __m512 a[3][8];
    qw_acc_io(a, acc, NH, ND16, 1);
    for (int j = 0, pair; j < n; j += 1 + pair, v += (1 + pair) * token_stride) {
        pair = pairs && j + 1 < n;
        __m512bh pj[3];
#pragma GCC unroll 3
        for (int g = 0; g < NH; g++) {
            uint32_t lo, hi = 0;
            memcpy(&lo, p + g * p_stride + j, sizeof lo);
            if (pair) memcpy(&hi, p + g * p_stride + j + 1, sizeof hi);
            pj[g] = (__m512bh)_mm512_set1_epi32((int)((hi & 0xffff0000u) | (lo >> 16)));
        }
        qw_dp_pair_step(a, v, pair ? v + token_stride : NULL, pj, ND16, NH);
    }
    qw_acc_io(a, acc, NH, ND16, 0);
}
#endif

#ifdef QW_AVX512
#ifndef QW_DP /* the fp32-product kernels (QW_DP has its own above) */
/* The GQA path of the "avx512" build (one KV head per item, D = 64 or 128): each K
 * and V row of the head is loaded (and converted) once for up to 3 of its query heads at a time,
 * instead of once per query head. NH (1..3) and ND16 (D / 16) are constants after inlining. */
static inline __attribute__((always_inline)) void FN(score8_heads)(const float *restrict q, const KV_T *restrict k,
                                                                 int64_t token_stride, int n, const int ND16, const int NH,
                                                                 float scale, float *restrict s, int64_t s_stride) {
    __m512 r[3][8];
    const KV_T *kt[8];
    FN(score8_start)(k, token_stride, n, NH, kt, r);
#pragma GCC unroll 8
    for (int i = 0; i < ND16; i++) {
        __m512 qv[3];
#pragma GCC unroll 3
        for (int g = 0; g < NH; g++) qv[g] = _mm512_loadu_ps(q + (int64_t)g * ND16 * 16 + 16 * i);
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m512 kv = LOADV(kt[t], i);
#pragma GCC unroll 3
            for (int g = 0; g < NH; g++) r[g][t] = _mm512_fmadd_ps(qv[g], kv, r[g][t]);
        }
    }
    qw_store_scores8(r, NH, n, scale, s, s_stride);
}

/* acc[g][0:D] += sum_{j<n} p[g][j] * v_j for NH query heads (p rows p_stride apart, acc rows D apart) */
static inline __attribute__((always_inline)) void FN(acc_heads)(const float *restrict p, int64_t p_stride,
                                                              const KV_T *restrict v, int64_t token_stride, int n,
                                                              const int ND16, const int NH, float *restrict acc) {
    __m512 a[3][8];
    qw_acc_io(a, acc, NH, ND16, 1);
    for (int j = 0; j < n; j++, v += token_stride) {
        __m512 pj[3];
#pragma GCC unroll 3
        for (int g = 0; g < NH; g++) pj[g] = _mm512_set1_ps(p[g * p_stride + j]);
#pragma GCC unroll 8
        for (int i = 0; i < ND16; i++) {
            const __m512 vv = LOADV(v, i);
#pragma GCC unroll 3
            for (int g = 0; g < NH; g++) a[g][i] = _mm512_fmadd_ps(pj[g], vv, a[g][i]);
        }
    }
    qw_acc_io(a, acc, NH, ND16, 0);
}

#endif /* QW_DP */

/* attend() with the GQA kernels above (D = 64 or 128): KV heads [h0, h1), each page read for all of
 * them before the next (one contiguous run), each K/V row for 3 query heads at a time. */
static inline __attribute__((always_inline)) void FN(attend_gqa_body)(QW_ATTEND_PARAMS, const int stream) {
    const int span = len - lo, ND16 = D / 16, nq = (h1 - h0) * G;
    const int num_blks = (len + block_size - 1) / block_size, blk0 = lo / block_size;
    qw_stream ahead = qw_stream_start(k_cache, v_cache, table, block_size, token_stride, h0, h1, D, sizeof(KV_T), lo, span);
#if defined(QW_DP)
    uint16_t q_bf[nq * D];
    for (int i = 0; i < nq * D; i++) q_bf[i] = f32_to_bf16(qs[i] * scale);
#elif defined(QW_PAIR_SPLIT)
    float q_split[nq * D];
    qw_pair_split(qs, q_split, nq * D);
    qs = q_split;
#endif
    for (int blk = blk0, run; blk < num_blks; blk += run) {
        run = qw_run_length(table, blk, num_blks);
        const int t0 = blk * block_size;
        const int n = len - t0 < run * block_size ? len - t0 : run * block_size;
        const KV_T *page = k_cache + (int64_t)table[blk] * block_size * token_stride;
        for (int c = lo > t0 ? lo - t0 : 0, ce; c < n; c = ce) {
            ce = c + QW_K_CHUNK < n ? c + QW_K_CHUNK : n;
            if (stream) qw_stream_to(&ahead, t0 + ce - lo);
            FN(touch_chunk)(page, c, ce, token_stride, h0, h1, D);
            for (int h = h0; h < h1; h++) {
                const KV_T *k = page + (int64_t)h * D;
                for (int j = c; j < ce; j += 8) {
                    const int m = ce - j < 8 ? ce - j : 8;
                    for (int g0 = 0; g0 < G; g0 += 3) {
                        const int nh = G - g0 < 3 ? G - g0 : 3, qh = (h - h0) * G + g0;
#if defined(QW_DP)
#define QW_SCORE(ND, NHC) FN(score8_heads_dp)(q_bf + (int64_t)qh * D, k + j * token_stride, token_stride, m, ND, NHC, \
                                              scores + (int64_t)qh * span + (t0 - lo) + j, span)
#else
#define QW_SCORE(ND, NHC) FN(score8_heads)(qs + (int64_t)qh * D, k + j * token_stride, token_stride, m, ND, NHC, scale, \
                                           scores + (int64_t)qh * span + (t0 - lo) + j, span)
#endif
                        QW_HEADS_SWITCH(QW_SCORE);
#undef QW_SCORE
                    }
                }
            }
        }
    }
    float inv_sum[nq];
#if defined(QW_DP)
    for (int qh = 0; qh < nq; qh++) inv_sum[qh] = qw_softmax_numerators_bf16(scores + (int64_t)qh * span, span, softcap, QW_SINK(qh));
#else
    for (int qh = 0; qh < nq; qh++) inv_sum[qh] = qw_softmax_numerators(scores + (int64_t)qh * span, span, softcap, QW_SINK(qh), NULL);
#endif
    memset(acc, 0, sizeof(float) * (size_t)nq * D);
    for (int blk = blk0, run; blk < num_blks; blk += run) {
        run = qw_run_length(table, blk, num_blks);
        const int t0 = blk * block_size;
        const int n = len - t0 < run * block_size ? len - t0 : run * block_size;
        const KV_T *page = v_cache + (int64_t)table[blk] * block_size * token_stride;
        for (int c = lo > t0 ? lo - t0 : 0, ce; c < n; c = ce) {
            ce = c + QW_V_CHUNK < n ? c + QW_V_CHUNK : n;
#if defined(QW_DP)
            /* a window's first token at an odd position goes alone: every later chunk then starts
             * at an even position (pages of an even size start at one), see acc_heads_dp */
            if ((t0 + c) & 1) ce = c + 1;
#endif
            if (stream) qw_stream_to(&ahead, span + t0 + ce - lo);
            FN(touch_chunk)(page, c, ce, token_stride, h0, h1, D);
            for (int h = h0; h < h1; h++) {
                const KV_T *v = page + c * token_stride + (int64_t)h * D;
                for (int g0 = 0; g0 < G; g0 += 3) {
                    const int nh = G - g0 < 3 ? G - g0 : 3, qh = (h - h0) * G + g0;
#if defined(QW_DP)
#define QW_ACC(ND, NHC) FN(acc_heads_dp)(scores + (int64_t)qh * span + (t0 - lo) + c, span, v, token_stride, ce - c, ND, \
                                         NHC, (block_size & 1) == 0, acc + (int64_t)qh * D)
#else
#define QW_ACC(ND, NHC) FN(acc_heads)(scores + (int64_t)qh * span + (t0 - lo) + c, span, v, token_stride, ce - c, ND, \
                                      NHC, acc + (int64_t)qh * D)
#endif
                    QW_HEADS_SWITCH(QW_ACC);
#undef QW_ACC
                }
            }
        }
    }
#if defined(QW_DP)
    for (int qh = 0; qh < nq; qh++) qw_dp_join(acc + (int64_t)qh * D, outs + (int64_t)qh * D, D, inv_sum[qh]);
#elif defined(QW_PAIR_SPLIT)
    for (int qh = 0; qh < nq; qh++) qw_pair_join(acc + (int64_t)qh * D, outs + (int64_t)qh * D, D, inv_sum[qh]);
#else
    for (int qh = 0; qh < nq; qh++)
        for (int d = 0; d < D; d++) outs[(int64_t)qh * D + d] = acc[(int64_t)qh * D + d] * inv_sum[qh];
#endif
}

/* attend_gqa_body without and with qw_stream, as attend */
static void FN(attend_gqa)(QW_ATTEND_PARAMS) { FN(attend_gqa_body)(QW_ATTEND_ARGS, 0); }
static void FN(attend_gqa_streamed)(QW_ATTEND_PARAMS) { FN(attend_gqa_body)(QW_ATTEND_ARGS, 1); }
#endif

/* First token a query at position len - 1 attends: len - window under a window (> 0), else 0. */
static inline int FN(window_start)(int len, int window) {
    return window > 0 && len > window ? len - window : 0;
}

/* Returns 0; -1 when a thread could not allocate its scratch (the caller falls back); -2, before
 * reading anything, when a live block-table entry (one the kernel would read) is outside
 * [0, num_blocks). window > 0: attend only the last `window` tokens; softcap > 0: cap the scores;
 * sinks (fp32 [Hq], or NULL): attention sinks, one more logit per query head in its softmax. */
int FN(qw_paged_decode)(const float *q, int64_t q_stride, const KV_T *k_cache,
                        const KV_T *v_cache, const int32_t *block_tables, int64_t table_stride,
                        const int32_t *seq_lens, float *out, int64_t out_stride, int B, int Hq,
                        int Hkv, int D, int block_size, float scale, int num_threads,
                        int64_t num_blocks, int window, float softcap, const float *sinks) {
    for (int b = 0; b < B; b++)
        for (int i = FN(window_start)(seq_lens[b], window) / block_size; i * block_size < seq_lens[b]; i++)
            if (block_tables[b * table_stride + i] < 0 || block_tables[b * table_stride + i] >= num_blocks) return -2;
    const int G = Hq / Hkv;
    const int64_t token_stride = (int64_t)Hkv * D;
    /* whole sequences when there are enough of them, else one KV head per item */
#ifdef QW_AVX512
    /* the GQA kernels are instantiated for D = 64 and 128 only (QW_HEADS_SWITCH); any other D
     * would run them with the wrong vector count and overrun the accumulators */
    const int gqa = D == 64 || D == 128;
#endif
    int heads_per_item = B < 2 * num_threads ? 1 : Hkv;
#if defined(QW_DP) && defined(QW_DECODE_AMX)
    /* the scores on tiles (paged_decode_amx.h), at most 16 query heads per item */
    const int amx = qw_decode_amx_applies(D, G, block_size);
    if (amx)
        while (heads_per_item * G > 16 || Hkv % heads_per_item) heads_per_item--;
#endif
    const int items_per_seq = Hkv / heads_per_item;
    const int nq = heads_per_item * G;
    int max_span = 1; /* the longest run of attended tokens: the scores scratch per query head */
    for (int b = 0; b < B; b++) {
        const int span = seq_lens[b] - FN(window_start)(seq_lens[b], window);
        max_span = span > max_span ? span : max_span;
    }
    size_t scores_floats = (size_t)nq * max_span;
#if defined(QW_DP) && defined(QW_DECODE_AMX)
    if (amx) scores_floats = (size_t)qw_amx_scratch_floats(heads_per_item, D, max_span);
#endif
    /* longest attended span first, then dynamic scheduling: the greedy longest-processing-time
     * split, so that no thread is left with a long sequence while the others idle at the end */
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(B > 0 ? B : 1));
    if (!order) return -1;
    for (int b = 0; b < B; b++)
        order[b] = ((int64_t)(seq_lens[b] - FN(window_start)(seq_lens[b], window)) << 32) | (int64_t)b;
    qsort(order, (size_t)B, sizeof(int64_t), qw_cmp_desc);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * (scores_floats + (size_t)nq * D));
        if (!scratch) failed = 1;
#if defined(QW_DP) && defined(QW_DECODE_AMX)
        else if (amx) qw_configure_tiles();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)B * items_per_seq; item++) {
            if (!scratch) continue;
            const int b = (int)(order[item / items_per_seq] & 0xffffffff), h0 = (int)(item % items_per_seq) * heads_per_item;
            const int len = seq_lens[b];
            float *outs = out + b * out_stride + (int64_t)h0 * G * D;
            if (len <= 0) {
                memset(outs, 0, sizeof(float) * (size_t)nq * D);
                continue;
            }
            const int32_t *table = block_tables + b * table_stride;
            const int lo = FN(window_start)(len, window), blk0 = lo / block_size;
            const int num_blks = (len + block_size - 1) / block_size;
            const int scattered = qw_run_length(table, blk0, num_blks) < num_blks - blk0;
            void (*attend_item)(QW_ATTEND_PARAMS) = scattered ? FN(attend_streamed) : FN(attend);
#ifdef QW_AVX512
            if (gqa) attend_item = scattered ? FN(attend_gqa_streamed) : FN(attend_gqa);
#endif
#if defined(QW_DP) && defined(QW_DECODE_AMX)
            if (amx) attend_item = qw_attend_amx;
#endif
            attend_item(q + b * q_stride + (int64_t)h0 * G * D, k_cache, v_cache, table, lo, len, block_size, token_stride,
                        h0, h0 + heads_per_item, G, D, scale, softcap, sinks ? sinks + (int64_t)h0 * G : NULL, scratch,
                        scratch + scores_floats, outs);
        }
#if defined(QW_DP) && defined(QW_DECODE_AMX)
        if (scratch && amx) _tile_release();
#endif
        free(scratch);
    }
    free(order);
    return failed ? -1 : 0;
}
