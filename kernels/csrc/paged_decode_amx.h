/* The bf16 mode's decode attention with its scores on AMX tiles (Sapphire Rapids and later): one
 * work item of qw_paged_decode_bf16_dp (paged_decode_impl.h), chosen there where the OS grants
 * AMX state, D is 64 or 128, G <= 16 and pages hold an even number of tokens.
 *
 * Why: the vector kernel's score pass spends most of its time folding 16-lane partial sums into
 * one score per (token, query head); with q in a tile the products land as whole scores:
 * S^T[16 tokens][query heads] = K[16 tokens][channels] . Q^T[channels][query heads], K's rows
 * the cache's own (A tiles loaded straight from the pages, `token_stride` apart), the scaled
 * bf16 q in AMX's pair layout the B tiles. A group of 16 rows that is not one stretch of memory
 * (a page edge between blocks that do not follow each other, the span's last tokens) is copied
 * into a staging tile first, unused rows zero.
 *
 * Precision is the vector kernel's (q scaled then rounded to bf16, fp32 sums, numerators rounded
 * to bf16, each row divided by the sum of its rounded numerators); only the order in which a
 * score's products are summed differs (the tile unit's), so the scores' bits may differ from the
 * vector kernel's, never with the batch, the pages' layout or the thread count: a token's score
 * is its own row's products with q, whichever tile row it sits in. The V pass is the vector
 * kernel's: tokens (2m, 2m + 1) by position meet their numerators as one bf16 pair in VDPBF16PS.
 *
 * An item holds at most 16 query heads (the driver splits a sequence's KV heads so): its scores
 * for 16 tokens are one 16 x 16 block, S[t][qh], each KV head's G columns from a C tile of that
 * head's own products (B tiles hold only its query heads' q, zeros in the other columns, which
 * are dropped: a non-finite K value of one head never reaches another's scores through a zero).
 * The block is token-major, so the softmax runs across the heads one lane each, and the
 * numerators are packed in place into the V pass's operand: PP[m][qh] = (bf16 p of token 2m + 1)
 * << 16 | bf16 p of token 2m, one broadcast load per pair and head.
 *
 * Measured (docs/benchmarks.md, Sapphire Rapids, SmolLM2's shapes, batch 128, 30 layers from
 * memory): 3-5% under the vector kernel. Decode attention there is bound by one core's memory
 * stream (~12 GB/s) plus the arithmetic, which does not overlap it; the score pass was about a
 * third of that arithmetic. */

#if defined(QW_DECODE_AMX)
#include "amx_tiles.h"

/* Whether an item of this shape takes qw_attend_amx: the GQA kernels' head sizes, at most 16 query
 * heads per KV head (one C tile's columns), pages of an even size (the V pass's pairs never
 * straddle two), and AMX state granted to this process. */
static inline int qw_decode_amx_applies(int D, int G, int block_size) {
    return (D == 64 || D == 128) && G >= 1 && G <= 16 && block_size % 2 == 0 && qw_gemm_bf16_amx_ready() == 2;
}

/* Items here hold at most 16 query heads (the driver picks heads_per_item so): S rows are 16
 * floats. Scratch an item needs besides acc, in floats: S (max_span rows), the q tiles (one of
 * 256 uint32 per 32-channel slice of the item's row), a staging tile (16 rows of nh * D bf16) and
 * two C tiles' sums (2 x 256). */
static inline int64_t qw_amx_scratch_floats(int nh, int D, int max_span) {
    return 16 * (int64_t)max_span + (int64_t)nh * (D / 32) * 256 + 8 * (int64_t)nh * D + 2 * 256;
}

/* The item's columns (`cols` bf16 from `col0` in each row) of positions [t, t + 16) as an A
 * operand, its row stride in *stride: the cache's own rows when they are one stretch of memory
 * (each block the one after the last), else a copy in `stage` (rows at `len` and past zero). */
static inline const uint16_t *qw_amx_rows(const uint16_t *cache, const int32_t *table, int block_size,
                                          int64_t token_stride, int64_t col0, int cols, int t, int len,
                                          uint16_t *stage, int64_t *stride) {
    int whole = t + 16 <= len;
    for (int b = t / block_size + 1; whole && b <= (t + 15) / block_size; b++)
        whole = table[b] == table[t / block_size] + (b - t / block_size);
    if (whole) {
        const uint16_t *a = cache + ((int64_t)table[t / block_size] * block_size + t % block_size) * token_stride + col0;
        *stride = token_stride * 2;
        qw_touch_rows(a, 16, *stride, (int64_t)cols * 2);
        return a;
    }
    for (int r = 0; r < 16; r++) {
        uint16_t *dst = stage + (int64_t)r * cols;
        if (t + r < len)
            memcpy(dst, cache + ((int64_t)table[(t + r) / block_size] * block_size + (t + r) % block_size) * token_stride + col0,
                   (size_t)cols * 2);
        else
            memset(dst, 0, (size_t)cols * 2);
    }
    *stride = (int64_t)cols * 2;
    return stage;
}

/* acc[g] += the V rows' pairs times PP's pairs for NH query heads (rows W apart in pp, D apart in
 * acc), pairs [0, npairs) of rows starting at v (token 2m at v + 2m * token_stride); `first_alone`:
 * the first pair's even token is outside the span (its row is not read), `last_alone`: the last
 * pair's odd token is. The accumulators hold the channels in the unpack order (qw_dp_join). */
static inline __attribute__((always_inline)) void qw_amx_acc_heads(const uint32_t *restrict pp, int W,
                                                                  const uint16_t *restrict v, int64_t token_stride,
                                                                  int npairs, int first_alone, int last_alone,
                                                                  const int ND16, const int NH, float *restrict acc) {
    __m512 a[3][8];
    qw_acc_io(a, acc, NH, ND16, 1);
    for (int m = 0; m < npairs; m++, v += 2 * token_stride, pp += W) {
        const int has0 = m > 0 || !first_alone, has1 = m < npairs - 1 || !last_alone;
        __m512bh pj[3];
#pragma GCC unroll 3
        for (int g = 0; g < NH; g++) pj[g] = (__m512bh)_mm512_set1_epi32((int)pp[g]);
        qw_dp_pair_step(a, has0 ? v : NULL, has1 ? v + token_stride : NULL, pj, ND16, NH);
    }
    qw_acc_io(a, acc, NH, ND16, 0);
}

/* One item (KV heads [h0, h1) of one sequence, at most 16 query heads, tokens [lo, len)),
 * QW_ATTEND_PARAMS as attend_gqa: `scores` holds qw_amx_scratch_floats(...) floats; the caller
 * configured the tiles (C 0-1, B 2-3, A 4-5). */
static void qw_attend_amx(QW_ATTEND_PARAMS) {
    const int nkv = h1 - h0, nq = nkv * G, span = len - lo, ND32 = D / 32, ND16 = D / 16, W = 16;
    float *S = scores;
    uint32_t *Bq = (uint32_t *)(S + 16 * (int64_t)span);
    uint16_t *stage = (uint16_t *)(Bq + (int64_t)nkv * ND32 * 256);
    float *sums = (float *)(stage + 16 * (int64_t)nkv * D);
    const int64_t row_bytes = token_stride * 2;
    /* q scaled and rounded to bf16 as B tiles: KV head hh's slice kk (channels [32 kk, 32 kk + 32))
     * holds in row r, column g, the pair of channels (32 kk + 2r, 32 kk + 2r + 1) of its query head g */
    memset(Bq, 0, sizeof(uint32_t) * (size_t)nkv * ND32 * 256);
    for (int qh = 0; qh < nq; qh++) {
        const float *qrow = qs + (int64_t)qh * D;
        uint32_t *slices = Bq + (int64_t)(qh / G) * ND32 * 256;
        for (int p = 0; p < D / 2; p++)
            slices[(int64_t)(p / 16) * 256 + (p % 16) * 16 + qh % G] =
                (uint32_t)f32_to_bf16(qrow[2 * p] * scale) | (uint32_t)f32_to_bf16(qrow[2 * p + 1] * scale) << 16;
    }
    const __mmask16 gmask = (__mmask16)((1u << G) - 1u);
    /* pass 1: S[t - lo][qh], 16 tokens at a time; a KV head's products in C tile 0 or 1 in turn
     * (B 2/3 and A 4/5 alternate along the slices), so one head's sums are copied out while the
     * next head's products run */
#define QW_HEAD_SCORES(C)                                                                             \
    do {                                                                                              \
        _tile_zero(C);                                                                                \
        for (int kk = 0; kk < ND32; kk += 2) { /* ND32 is 2 or 4 */                                   \
            _tile_loadd(2, Bq + (int64_t)(hh * ND32 + kk) * 256, 64);                                 \
            _tile_loadd(4, a + (int64_t)hh * D + 32 * kk, sa);                                        \
            _tile_dpbf16ps(C, 4, 2);                                                                  \
            _tile_loadd(3, Bq + (int64_t)(hh * ND32 + kk + 1) * 256, 64);                             \
            _tile_loadd(5, a + (int64_t)hh * D + 32 * (kk + 1), sa);                                  \
            _tile_dpbf16ps(C, 5, 3);                                                                  \
        }                                                                                             \
        _tile_stored(C, sums + (C) * 256, 64);                                                        \
    } while (0)
    for (int t = lo; t < len; t += 16) {
        int64_t sa;
        const int m = len - t < 16 ? len - t : 16;
        const uint16_t *a = qw_amx_rows(k_cache, table, block_size, token_stride, (int64_t)h0 * D, nkv * D, t, len, stage, &sa);
        for (int hh = 0; hh < nkv; hh++) {
            if (hh & 1) QW_HEAD_SCORES(1);
            else QW_HEAD_SCORES(0);
            TILES_STORED();
            const float *c = sums + (hh & 1) * 256;
            for (int r = 0; r < m; r++) _mm512_mask_storeu_ps(S + (int64_t)(t - lo + r) * W + hh * G, gmask, _mm512_loadu_ps(c + 16 * r));
        }
    }
#undef QW_HEAD_SCORES
    /* softmax numerators across the query heads (one lane each), rounded to bf16; then packed in
     * place into pairs by position: PP row k = pair m0 + k (tokens 2m, 2m + 1), m0 = lo / 2 (a
     * row is written only after the rows it packs were read) */
    const __mmask16 lanes = (__mmask16)((1u << nq) - 1u);
    if (softcap > 0.0f)
        for (int t = 0; t < span; t++)
            for (int qh = 0; qh < nq; qh++) S[(int64_t)t * W + qh] = qw_softcap(S[(int64_t)t * W + qh], softcap);
    const __m512 sink = sinks ? _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes, sinks) : _mm512_set1_ps(-INFINITY);
    __m512 mx = sink;
    __mmask16 nan = 0; /* a NaN score makes its head's output NaN, as in the vector kernel */
    for (int t = 0; t < span; t++) {
        const __m512 x = _mm512_maskz_loadu_ps(lanes, S + (int64_t)t * W);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, x);
    }
    /* the sink's numerator joins the sum unrounded (it multiplies no value) */
    const __mmask16 has_sink = _mm512_cmp_ps_mask(sink, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    __m512 sum = _mm512_maskz_mov_ps(has_sink, exp_nonpositive16(_mm512_sub_ps(sink, mx)));
    for (int t = 0; t < span; t++) {
        const __m512i p = round_bf16_16(exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, S + (int64_t)t * W), mx)));
        sum = _mm512_add_ps(sum, _mm512_castsi512_ps(p));
        _mm512_storeu_si512(S + (int64_t)t * W, p);
    }
    float inv_sum[16];
    _mm512_storeu_ps(inv_sum, _mm512_mask_mov_ps(_mm512_div_ps(_mm512_set1_ps(1.0f), sum), nan, _mm512_set1_ps(NAN)));
    const int m0 = lo / 2, m1 = (len - 1) / 2; /* the pairs [m0, m1] */
    for (int mm = m0; mm <= m1; mm++) {
        const int t0 = 2 * mm, t1 = 2 * mm + 1;
        const __m512i p0 = t0 >= lo ? _mm512_loadu_si512(S + (int64_t)(t0 - lo) * W) : _mm512_setzero_si512();
        const __m512i p1 = t1 < len ? _mm512_loadu_si512(S + (int64_t)(t1 - lo) * W) : _mm512_setzero_si512();
        _mm512_storeu_si512(S + (int64_t)(mm - m0) * W,
                            _mm512_or_si512(_mm512_and_si512(p1, _mm512_set1_epi32((int)0xffff0000u)), _mm512_srli_epi32(p0, 16)));
    }
    const uint32_t *PP = (const uint32_t *)S;
    /* pass 2: the V sums, QW_V_CHUNK tokens (an even number) at a time, pairs by position */
    memset(acc, 0, sizeof(float) * (size_t)nq * D);
    for (int mm = m0; mm <= m1;) {
        const int t = 2 * mm, blk = t / block_size, in_page = t - blk * block_size;
        int n = (block_size - in_page) / 2; /* pairs left in this page (block_size even) */
        n = n < QW_V_CHUNK / 2 ? n : QW_V_CHUNK / 2;
        n = n < m1 + 1 - mm ? n : m1 + 1 - mm;
        const uint16_t *page = v_cache + ((int64_t)table[blk] * block_size + in_page) * token_stride;
        const int first_alone = t < lo, last_alone = 2 * (mm + n - 1) + 1 >= len;
        qw_touch_rows(page + (first_alone ? token_stride : 0) + (int64_t)h0 * D, 2 * n - first_alone - last_alone, row_bytes,
                      (int64_t)nkv * D * 2);
        for (int h = h0; h < h1; h++) {
            const uint16_t *v = page + (int64_t)h * D;
            for (int g0 = 0; g0 < G; g0 += 3) {
                const int nh = G - g0 < 3 ? G - g0 : 3, qh = (h - h0) * G + g0;
#define QW_ACC(ND, NHC) qw_amx_acc_heads(PP + (int64_t)(mm - m0) * W + qh, W, v, token_stride, n, first_alone, \
                                         last_alone, ND, NHC, acc + (int64_t)qh * D)
                QW_HEADS_SWITCH(QW_ACC);
#undef QW_ACC
            }
        }
        mm += n;
    }
    for (int qh = 0; qh < nq; qh++) qw_dp_join(acc + (int64_t)qh * D, outs + (int64_t)qh * D, D, inv_sum[qh]);
}
#endif /* QW_DECODE_AMX */
