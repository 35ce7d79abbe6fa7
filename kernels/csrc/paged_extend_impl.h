/* The body of paged_extend.c, instantiated once per cache element type. Expects:
 *   KV_T       the cache element type (float, or uint16_t holding fp16 / bf16)
 *   LOAD1(p)   one cache element at p as a float
 *   FN(name)   name with the type's suffix
 */

/* Keys [c0, c0 + n) of KV head h into Kt (transposed: Kt[d * NK + j]) and V (V[j * D + d]) as fp32;
 * columns n..NK of Kt are zeroed (their scores are computed and then discarded). */
static void FN(load_chunk)(const KV_T *restrict k_cache, const KV_T *restrict v_cache, const int32_t *restrict table,
                           int c0, int n, int block_size, int64_t token_stride, int h, int D, float *restrict Kt,
                           float *restrict V) {
    for (int j = 0; j < n; j++) {
        const int t = c0 + j;
        const int64_t at = ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride + (int64_t)h * D;
        const KV_T *restrict kr = k_cache + at;
        const KV_T *restrict vr = v_cache + at;
        for (int d = 0; d < D; d++) Kt[(int64_t)d * QW_NK + j] = LOAD1(kr + d);
        float *restrict vo = V + (int64_t)j * D;
#pragma omp simd
        for (int d = 0; d < D; d++) vo[d] = LOAD1(vr + d);
    }
    if (n < QW_NK)
        for (int d = 0; d < D; d++) memset(Kt + (int64_t)d * QW_NK + n, 0, sizeof(float) * (QW_NK - n));
}

/* One item: query rows [i0, i1) of sequence b (positions prefix + i), KV head h, its G query heads.
 * Rows of the block are r = (i - i0) * G + g. Scratch (R padded to RB): Q (the scaled queries in
 * blocks of RB rows, each block channel-major: Q[(r / RB) * D * RB + d * RB + r % RB]), O (R x D),
 * S (R x NK), Kt (D x NK), V (NK x D), m, l, alpha (R). */
static void FN(extend_item)(const float *restrict q, int64_t q_stride, const KV_T *restrict k_cache,
                            const KV_T *restrict v_cache, const int32_t *restrict table, int row0, int prefix,
                            int i0, int i1, int h, int G, int D, int block_size, int64_t token_stride, float scale,
                            int window, float softcap, const float *sinks, float *restrict out, int64_t out_stride,
                            float *restrict scratch) {
    const int nrow = i1 - i0, R = nrow * G, Rpad = (R + QW_RB - 1) / QW_RB * QW_RB;
    float *Q = scratch, *O = Q + (int64_t)Rpad * D, *S = O + (int64_t)Rpad * D, *Kt = S + (int64_t)Rpad * QW_NK;
    float *V = Kt + (int64_t)D * QW_NK, *m = V + (int64_t)QW_NK * D, *l = m + Rpad, *alpha = l + Rpad;
    memset(Q + (int64_t)R / QW_RB * QW_RB * D, 0, sizeof(float) * (size_t)(Rpad - R / QW_RB * QW_RB) * D);
    for (int i = 0; i < nrow; i++)
        for (int g = 0; g < G; g++) {
            const int r = i * G + g;
            const float *src = q + (int64_t)(row0 + i0 + i) * q_stride + (int64_t)(h * G + g) * D;
            float *dst = Q + (int64_t)(r / QW_RB) * D * QW_RB + r % QW_RB;
            for (int d = 0; d < D; d++) dst[(int64_t)d * QW_RB] = src[d] * scale;
        }
    memset(O, 0, sizeof(float) * (size_t)Rpad * D);
    for (int r = 0; r < Rpad; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    int kmin, kend, a, e, ilo, ihi;
    qw_x_keys(prefix, i0, i1, window, &kmin, &kend);
    for (int c0 = kmin / QW_NK * QW_NK; c0 < kend; c0 += QW_NK) {
        if (!qw_x_chunk(c0, QW_NK, kmin, kend, prefix, i0, i1, window, &a, &e, &ilo, &ihi)) continue;
        FN(load_chunk)(k_cache, v_cache, table, a, e - a, block_size, token_stride, h, D, Kt, V);
        const int r0 = (ilo - i0) * G, r1 = (ihi - i0) * G;
        for (int r = r0 / QW_RB * QW_RB; r < r1; r += QW_RB)
            qw_x_scores(Q + (int64_t)r * D, Kt, D, S + (int64_t)r * QW_NK); /* r * D: block r / RB */
        for (int r = r0; r < r1; r++) {
            const int pos = prefix + i0 + r / G;
            /* this row's keys in the chunk, as offsets from a: [j0, j1) */
            const int j1 = (pos + 1 < e ? pos + 1 : e) - a;
            const int j0 = window > 0 && pos - window + 1 > a ? pos - window + 1 - a : 0;
            float *restrict s = S + (int64_t)r * QW_NK;
            if (softcap > 0.0f) {
#pragma omp simd
                for (int j = j0; j < j1; j++) s[j] = qw_softcap(s[j], softcap);
            }
            float cm = -INFINITY;
            /* a vector max (exact in any order): the scalar chain of dependent maxes was a sixth of
             * the kernel's time */
#pragma omp simd reduction(max : cm)
            for (int j = j0; j < j1; j++) cm = s[j] > cm ? s[j] : cm;
            const float mn = cm > m[r] ? cm : m[r];
            alpha[r] = exp_nonpositive(m[r] - mn); /* m = -inf at first: alpha ~ 0 scales zeros */
            m[r] = mn;
            float sum = 0.0f;
            for (int j = 0; j < j0; j++) s[j] = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = j0; j < j1; j++) {
                s[j] = exp_nonpositive(s[j] - mn);
                sum += s[j];
            }
            for (int j = j1; j < QW_NK; j++) s[j] = 0.0f;
            l[r] = l[r] * alpha[r] + sum;
        }
        qw_x_pv(S + (int64_t)r0 * QW_NK, V, e - a, D, r1 - r0, alpha + r0, O + (int64_t)r0 * D);
    }
    for (int i = 0; i < nrow; i++)
        for (int g = 0; g < G; g++) {
            const int r = i * G + g;
            const float inv = 1.0f / (l[r] + qw_x_sink_term(sinks, h * G + g, m[r]));
            float *dst = out + (int64_t)(row0 + i0 + i) * out_stride + (int64_t)(h * G + g) * D;
#pragma omp simd
            for (int d = 0; d < D; d++) dst[d] = O[(int64_t)r * D + d] * inv;
        }
}

/* Returns 0; -1 when scratch memory could not be allocated (the caller falls back); -2, before
 * reading anything, when a block-table entry the kernel would read is outside [0, num_blocks) or a
 * sequence's query rows do not fit its length. window > 0: a query at p sees keys (p - window, p];
 * softcap > 0: scores become softcap * tanh(score / softcap); sinks (fp32 [Hq], or NULL): attention
 * sinks, one more logit per query head in its softmax. */
int FN(qw_paged_extend)(const float *q, int64_t q_stride, const KV_T *k_cache, const KV_T *v_cache,
                        const int32_t *block_tables, int64_t table_stride, const int32_t *query_start_loc,
                        const int32_t *seq_lens, float *out, int64_t out_stride, int B, int Hq, int Hkv, int D,
                        int block_size, float scale, int num_threads, int64_t num_blocks, int window, float softcap,
                        const float *sinks) {
    const int G = Hq / Hkv;
    const int tm = qw_x_rows_per_item(G);
    qw_x_item *items;
    const int64_t n_items = qw_x_plan(B, Hkv, tm, block_size, window, num_blocks, block_tables, table_stride,
                                      query_start_loc, seq_lens, &items);
    if (n_items <= 0) return (int)n_items;
    const int Rpad = (tm * G + QW_RB - 1) / QW_RB * QW_RB;
    const size_t floats = (size_t)Rpad * D * 2 + (size_t)Rpad * QW_NK + (size_t)D * QW_NK * 2 + (size_t)Rpad * 3;
    const int64_t token_stride = (int64_t)Hkv * D;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        float *scratch = malloc(sizeof(float) * floats);
        if (!scratch) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < n_items; it++) {
            if (!scratch) continue;
            const qw_x_item w = items[it];
            FN(extend_item)(q, q_stride, k_cache, v_cache, block_tables + w.b * table_stride, query_start_loc[w.b],
                            seq_lens[w.b] - (query_start_loc[w.b + 1] - query_start_loc[w.b]), w.i0, w.i1, w.h, G, D,
                            block_size, token_stride, scale, window, softcap, sinks, out, out_stride, scratch);
        }
        free(scratch);
    }
    free(items);
    return failed ? -1 : 0;
}
