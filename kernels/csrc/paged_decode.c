/*
 * Paged decode attention for the CPU engine: one query token per sequence against its K/V,
 * read in place through the block table (no gathered copy of the context).
 *
 * Layout (the same as every kernel in this package, see kernels/reference.py):
 *   q            [B, Hq, D]                          row b at q + b * q_stride
 *   k/v cache    [num_blocks, block_size, Hkv, D]    contiguous, fp32 or fp16
 *   block_tables [B, max_blocks] int32               row b at block_tables + b * table_stride
 *   seq_lens     [B] int32                           context length, query at position len - 1
 *   out          [B, Hq, D]                          row b at out + b * out_stride
 * GQA: query head g * G .. reads KV head h = g / G, G = Hq / Hkv; K/V are never repeated.
 *
 * Work items are sequences (or, when there are too few sequences to keep every thread busy,
 * (sequence, KV head) pairs), each done by one thread, longest attended span first under dynamic
 * scheduling (the greedy longest-processing-time split: no thread is left with one long sequence
 * while the others idle). Both passes walk the sequence's pages in
 * order (a run of consecutive block ids as one page: qw_run_length), a chunk of tokens at a time
 * (QW_K_CHUNK, QW_V_CHUNK): the chunk's rows are first touched line by line in address order, then
 * computed for every head the item owns, so every page is read from memory once, front to back:
 * scores (q . k) for all heads, a softmax per query head, then the weighted sum of V rows. An item
 * whose pages are scattered also asks for its rows into L2 ahead of its reads (qw_stream).
 * Under a sliding window only the pages holding the last `window` tokens are read; soft-capping
 * (Gemma 2) maps each score s to softcap * tanh(s / softcap) before the softmax.
 * q, out and all arithmetic are fp32; the cache is fp32, fp16 (converted on load, F16C, or bit by
 * bit without it) or bf16 (converted on load: a 16-bit shift), one copy of paged_decode_impl.h each.
 *
 * kernels/cpu.py builds this file once per vector ISA: with AVX-512 (D = 64 or 128)
 * the GQA kernels load each K/V row once for up to 3 query heads of its KV head (16-float
 * vectors); with AVX2+FMA+F16C the 8-float kernels run one query head at a time; otherwise
 * plain loops the compiler vectorises as it can.
 *
 * Built by kernels/cpu.py with -O3 -march=native -fopenmp and loaded with ctypes. libgomp is the
 * same library torch loaded (same soname), so this code and torch share one OpenMP thread pool.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "exp.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QW_AVX 1
#endif
/* the "avx512" build: 16-float vectors where D is a multiple of 16 (the 8-float path otherwise) */
#if defined(QW_AVX) && defined(__AVX512F__)
#define QW_AVX512 1
#endif

/* One query head's scores over its attended span, in place: soft-capped (when cap > 0), then the
 * softmax numerators exp(s - max). Returns 1 / their sum, which the caller applies once to the
 * weighted V sum (both decode paths share this pass). sink > -inf: an attention sink (gpt-oss), one
 * more logit in the softmax with no value: it joins the max and adds exp(sink - max) to the sum,
 * *sink_term (when not NULL) receiving that numerator. */
static inline float qw_softmax_numerators(float *restrict s, int span, float cap, float sink, float *sink_term) {
    if (cap > 0.0f) {
#pragma omp simd
        for (int t = 0; t < span; t++) s[t] = qw_softcap(s[t], cap);
    }
    float m = s[0];
#pragma omp simd reduction(max : m)
    for (int t = 0; t < span; t++) m = s[t] > m ? s[t] : m;
    if (sink > m) m = sink;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < span; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        sum += s[t];
    }
    const float extra = sink > -INFINITY ? exp_nonpositive(sink - m) : 0.0f;
    if (sink_term) *sink_term = extra;
    return 1.0f / (sum + extra);
}

/* How many blocks from table[blk] on (at most up to `end`) have consecutive ids: such a run is one
 * contiguous stretch of the cache, walked as one page (the pool allocates in runs where it can,
 * qworker/engine/block_pool.py). Results are the same either way: every token's score is its own
 * sum, and the V sums add the tokens in the same order; a run only saves the per-page work
 * (accumulators stored and reloaded, a partial 8-token group, the page's prefetch). */
static inline int qw_run_length(const int32_t *table, int blk, int end) {
    int run = 1;
    while (blk + run < end && table[blk + run] == table[blk] + run) run++;
    return run;
}

/* qsort order: descending int64 keys (a sequence's span in the high half, its index in the low) */
static int qw_cmp_desc(const void *a, const void *b) {
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x < y) - (x > y);
}

#ifdef QW_AVX512
/* lane t of the result = the sum of r_t's 8 lanes (the 8-token transpose-and-add) */
static inline __m256 qw_fold8(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5, __m256 r6, __m256 r7) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(r0, r1), _mm256_hadd_ps(r2, r3));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(r4, r5), _mm256_hadd_ps(r6, r7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
static inline __m256 qw_half_sum(__m512 r) {
    return _mm256_add_ps(_mm512_castps512_ps256(r), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(r), 1)));
}

/* The GQA score kernels' end: the 8 tokens' sums of NH heads' accumulators r[g][t], times scale,
 * into s[g * s_stride + t] for t < n. */
static inline __attribute__((always_inline)) void qw_store_scores8(__m512 r[3][8], const int NH, int n, float scale,
                                                                   float *restrict s, int64_t s_stride) {
    const __m256 vs = _mm256_set1_ps(scale);
#pragma GCC unroll 3
    for (int g = 0; g < NH; g++) {
        const __m256 sums = _mm256_mul_ps(qw_fold8(qw_half_sum(r[g][0]), qw_half_sum(r[g][1]), qw_half_sum(r[g][2]),
                                                   qw_half_sum(r[g][3]), qw_half_sum(r[g][4]), qw_half_sum(r[g][5]),
                                                   qw_half_sum(r[g][6]), qw_half_sum(r[g][7])), vs);
        if (n == 8) {
            _mm256_storeu_ps(s + g * s_stride, sums);
        } else {
            float tmp[8];
            _mm256_storeu_ps(tmp, sums);
            for (int t = 0; t < n; t++) s[g * s_stride + t] = tmp[t];
        }
    }
}

/* The GQA V kernels' accumulators of NH heads (ND16 vectors each, acc rows ND16 * 16 apart):
 * loaded from acc (load 1) or stored back (load 0). */
static inline __attribute__((always_inline)) void qw_acc_io(__m512 a[3][8], float *restrict acc, const int NH,
                                                            const int ND16, int load) {
#pragma GCC unroll 3
    for (int g = 0; g < NH; g++)
#pragma GCC unroll 8
        for (int i = 0; i < ND16; i++) {
            float *at = acc + (int64_t)g * ND16 * 16 + 16 * i;
            if (load)
                a[g][i] = _mm512_loadu_ps(at);
            else
                _mm512_storeu_ps(at, a[g][i]);
        }
}

/* CALL(ND16, NH) with both as constants (the GQA kernels are instantiated for D = 64 or 128 and
 * 1-3 query heads at a time); ND16 and nh are the caller's variables */
#define QW_HEADS_SWITCH(CALL)                                                                                         \
    do {                                                                                                              \
        if (ND16 == 4) {                                                                                              \
            if (nh == 3) CALL(4, 3); else if (nh == 2) CALL(4, 2); else CALL(4, 1);                                   \
        } else {                                                                                                      \
            if (nh == 3) CALL(8, 3); else if (nh == 2) CALL(8, 2); else CALL(8, 1);                                   \
        }                                                                                                             \
    } while (0)

/* The pair-split order of the bf16 GQA kernels (see LOADV below), n a multiple of 32: in each run
 * of 32 values, the 16 at even offsets, then the 16 at odd ones. */
static inline void qw_pair_split(const float *restrict src, float *restrict dst, int n) {
    for (int c = 0; c < n; c += 32)
        for (int j = 0; j < 16; j++) {
            dst[c + j] = src[c + 2 * j];
            dst[c + 16 + j] = src[c + 2 * j + 1];
        }
}

#ifdef __AVX512BF16__
/* The bf16 mode's decode (qw_paged_decode_bf16_dp): qw_softmax_numerators with each numerator
 * rounded to bf16 (nearest even) for the P . V product, and 1 / the sum of the rounded ones, so a
 * row is normalised by what it was multiplied by (as csrc/paged_extend_bf16_products.c). */
static inline float qw_softmax_numerators_bf16(float *restrict s, int span, float cap, float sink) {
    float sum;
    (void)qw_softmax_numerators(s, span, cap, sink, &sum); /* exp(s - max) in place; its sum is of the unrounded */
#pragma omp simd reduction(+ : sum)
    for (int t = 0; t < span; t++) {
        s[t] = bf16_to_f32(f32_to_bf16(s[t]));
        sum += s[t];
    }
    return 1.0f / sum;
}

/* The V step of the bf16-product decode kernels: a[g][2i], a[g][2i + 1] += the rows v0 and v1
 * (tokens 2m and 2m + 1; NULL: a row of zeros) interleaved 16 bits at a time (unpacklo/hi within
 * each 128-bit lane) times NH query heads' broadcast numerator pairs pj[g], one VDPBF16PS each,
 * over the ND16 / 2 64-byte slices of a row. */
static inline __attribute__((always_inline)) void qw_dp_pair_step(__m512 a[3][8], const uint16_t *v0, const uint16_t *v1,
                                                                  const __m512bh pj[3], const int ND16, const int NH) {
#pragma GCC unroll 4
    for (int i = 0; i < ND16 / 2; i++) {
        const __m512i r0 = v0 ? _mm512_loadu_si512((const void *)(v0 + 32 * i)) : _mm512_setzero_si512();
        const __m512i r1 = v1 ? _mm512_loadu_si512((const void *)(v1 + 32 * i)) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(r0, r1), hi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
#pragma GCC unroll 3
        for (int g = 0; g < NH; g++) {
            a[g][2 * i] = _mm512_dpbf16_ps(a[g][2 * i], lo, pj[g]);
            a[g][2 * i + 1] = _mm512_dpbf16_ps(a[g][2 * i + 1], hi, pj[g]);
        }
    }
}

/* dst = src * scale in natural order from acc_heads_dp's unpack order: in each 32-channel group,
 * lane l of the first 16 holds channel 8 (l / 4) + l % 4, of the second 16 channel 8 (l / 4) + 4 + l % 4 */
static inline void qw_dp_join(const float *restrict src, float *restrict dst, int n, float scale) {
    for (int c = 0; c < n; c += 32)
        for (int l = 0; l < 16; l++) {
            dst[c + 8 * (l / 4) + l % 4] = src[c + l] * scale;
            dst[c + 8 * (l / 4) + 4 + l % 4] = src[c + 16 + l] * scale;
        }
}
#endif

/* dst = src * scale back in natural order (the inverse of qw_pair_split) */
static inline void qw_pair_join(const float *restrict src, float *restrict dst, int n, float scale) {
    for (int c = 0; c < n; c += 32)
        for (int j = 0; j < 16; j++) {
            dst[c + 2 * j] = src[c + j] * scale;
            dst[c + 2 * j + 1] = src[c + 16 + j] * scale;
        }
}
#endif

/* Tokens per chunk: each pass reads its pages a chunk at a time, first touching every cache line
 * of the chunk's rows in address order (qw_touch_rows), then computing head by head from L1/L2.
 * The heads of a token sit side by side in a row ([block_size, Hkv, D]), so head-by-head
 * compute jumps back and forth through memory; the hardware prefetcher follows only an ascending
 * stream of demand misses (a pure read of the same bytes head by head: 35 ms against 20 in address
 * order, on Zen 4), so without the touch decode attention ran at half the machine's bandwidth.
 * Chunks of 8 tokens for the scores, 32 for the V sums (whose accumulators are stored and
 * reloaded per chunk) measured best (docs/benchmarks.md); -D overrides them for such trials. */
#ifndef QW_K_CHUNK
#define QW_K_CHUNK 8
#endif
#ifndef QW_V_CHUNK
#define QW_V_CHUNK 32
#endif
/* the score chunk of the plain (non-GQA) path, a multiple of its 8- and 16-token groups */
#ifndef QW_PLAIN_CHUNK
#define QW_PLAIN_CHUNK 16
#endif

/* One demand load per 64-byte line of `bytes` bytes at the start of each of `rows` rows
 * `row_bytes` apart, in address order: the stream the hardware prefetcher trains on. */
static inline void qw_touch_rows(const void *first, int rows, int64_t row_bytes, int64_t bytes) {
    const char *r = (const char *)first;
    for (int t = 0; t < rows; t++, r += row_bytes)
        for (int64_t o = 0; o < bytes; o += 64) (void)*(volatile const char *)(r + o);
}

/* How far ahead of its reads an item asks for its rows, in bytes (4-16 KiB measured alike). */
#ifndef QW_STREAM_AHEAD
#define QW_STREAM_AHEAD 8192
#endif

/* The rows an item will read, asked for into L2 (PREFETCHT1) a fixed distance ahead of the
 * reads: its K rows from the first attended token to the last, then its V rows the same way,
 * across the pages wherever they lie. A page is 3-12 KiB, and the hardware prefetcher, which
 * trains on each 4 KiB page anew, leaves a core reading such scattered pages at ~10 GB/s against
 * ~31 GB/s streaming (Zen 4); an L2 prefetch queue kept this full lifts it to ~18 (one core) and
 * ~25 GB/s (two). Prefetches into L1 (PREFETCHT0) wait on L1's few miss buffers and gain nothing.
 * A hint only: results do not depend on it. */
typedef struct {
    const char *k, *v;   /* the K and V caches */
    const int32_t *table;
    int64_t page_bytes;  /* block_size rows */
    int64_t row_bytes;   /* token_stride elements */
    int64_t offset;      /* where the item's heads start in a row */
    int64_t bytes;       /* the item's part of a row */
    int block_size, lo, span;
    int next;            /* rows asked for so far: 0 .. 2 * span (K rows, then V rows) */
    int ahead;           /* the distance in rows */
} qw_stream;

/* the stream of an item: KV heads [h0, h1) of rows token_stride elements of elt bytes apart */
static inline qw_stream qw_stream_start(const void *k, const void *v, const int32_t *table, int block_size,
                                        int64_t token_stride, int h0, int h1, int D, int64_t elt, int lo, int span) {
    const int64_t row_bytes = token_stride * elt, bytes = (int64_t)(h1 - h0) * D * elt;
    qw_stream s = {(const char *)k, (const char *)v, table, block_size * row_bytes, row_bytes, (int64_t)h0 * D * elt,
                   bytes, block_size, lo, span, 0, (int)((QW_STREAM_AHEAD + bytes - 1) / bytes)};
    return s;
}

/* Ask for the rows up to `done` rows (of the 2 * span) plus the distance ahead, a page at a time. */
static inline void qw_stream_to(qw_stream *s, int done) {
    const int upto = done + s->ahead < 2 * s->span ? done + s->ahead : 2 * s->span;
    while (s->next < upto) {
        const int v = s->next >= s->span, t = s->lo + s->next - (v ? s->span : 0);
        const int blk = t / s->block_size, in_page = t - blk * s->block_size;
        int rows = s->block_size - in_page; /* this page's rows from t on, within K or V and below upto */
        const int end = v ? upto : (upto < s->span ? upto : s->span);
        rows = rows < end - s->next ? rows : end - s->next;
        /* a page that continues its predecessor in memory is the hardware prefetcher's */
        if (t - in_page <= s->lo || s->table[blk] != s->table[blk - 1] + 1) {
            const char *row = (v ? s->v : s->k) + s->table[blk] * s->page_bytes + in_page * s->row_bytes + s->offset;
            for (int r = 0; r < rows; r++, row += s->row_bytes)
                for (int64_t o = 0; o < s->bytes; o += 64) __builtin_prefetch(row + o, 0, 2);
        }
        s->next += rows;
    }
}

/* The parameters of one work item's attention (paged_decode_impl.h's attend and attend_gqa). */
#define QW_ATTEND_PARAMS                                                                                             \
    const float *restrict qs, const KV_T *restrict k_cache, const KV_T *restrict v_cache,                            \
        const int32_t *restrict table, int lo, int len, int block_size, int64_t token_stride, int h0, int h1, int G, \
        int D, float scale, float softcap, const float *restrict sinks, float *restrict scores, float *restrict acc, \
        float *restrict outs
#define QW_ATTEND_ARGS qs, k_cache, v_cache, table, lo, len, block_size, token_stride, h0, h1, G, D, scale, softcap, \
                       sinks, scores, acc, outs
/* query head qh's sink logit (sinks: the item's first query head's, or NULL for none) */
#define QW_SINK(qh) (sinks ? sinks[qh] : -INFINITY)

#define QW_CAT2(a, b) a##_##b
#define QW_CAT(a, b) QW_CAT2(a, b)

/* fp32 cache: qw_paged_decode_f32 */
#define KV_T float
#define LOAD8(p) _mm256_loadu_ps(p)
#define LOAD16(p) _mm512_loadu_ps(p)
#define LOAD1(p) (*(p))
#define LOADV(row, i) LOAD16((row) + 16 * (i))
#define FN(name) QW_CAT(name, f32)
#include "paged_decode_impl.h"
#undef KV_T
#undef LOAD8
#undef LOAD16
#undef LOADV
#undef LOAD1
#undef FN

/* fp16 cache (half the memory traffic of decode, which is memory-bound): qw_paged_decode_f16.
 * Converted by F16C where the build has it, else bit by bit (the "generic" build). */
#define KV_T uint16_t
#if defined(QW_AVX) && defined(__F16C__)
#define LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LOAD1(p) _cvtsh_ss(*(p))
#else
#define LOAD1(p) qw_f16_to_f32(*(p))
#endif
#define LOADV(row, i) LOAD16((row) + 16 * (i))
#define FN(name) QW_CAT(name, f16)
static inline float qw_f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13); /* normal: rebias 15 -> 127 */
    } else {
        const float f = (float)man * 5.9604644775390625e-8f; /* subnormal (or zero): man * 2^-24 */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
#include "paged_decode_impl.h"
#undef KV_T
#if defined(QW_AVX) && defined(__F16C__)
#undef LOAD8
#undef LOAD16
#endif
#undef LOADV
#undef LOAD1
#undef FN

/* bf16 cache (half the traffic as well; the upper 16 bits of an fp32): qw_paged_decode_bf16 */
#define KV_T uint16_t
#ifdef QW_AVX
#define LOAD8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#endif
#define LOAD1(p) qw_bf16_to_f32(*(p))
#ifdef QW_AVX512
/* The GQA kernels' vectors of a bf16 row in "pair-split" order: one 64-byte load of 32 elements
 * gives two 16-float vectors in two single-uop instructions, the even elements (each 32-bit lane
 * shifted left by 16) and the odd ones (the lane's upper half kept). That is half the conversion
 * work of widening 16 elements at a time (a shuffle and a shift per 16). q and the V sums are
 * permuted to the same order (qw_pair_split / qw_pair_join); the V sums are unchanged, the
 * scores' fp32 sums run over the channels in another order. */
#define QW_PAIR_SPLIT 1
#define LOADV(row, i)                                                                                          \
    (((i) & 1) ? _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512((const void *)((row) + 32 * ((i) >> 1))), \
                                                      _mm512_set1_epi32((int)0xffff0000u)))                  \
               : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512((const void *)((row) + 32 * ((i) >> 1))), 16)))
#endif
#define FN(name) QW_CAT(name, bf16)
static inline float qw_bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#include "paged_decode_impl.h"
#undef KV_T
#ifdef QW_AVX
#undef LOAD8
#undef LOAD16
#endif
#ifdef QW_AVX512
#undef LOADV
#undef QW_PAIR_SPLIT
#endif
#undef LOAD1
#undef FN

/* bf16 cache, the bf16 mode's products in bf16 (VDPBF16PS): qw_paged_decode_bf16_dp. Precision
 * as csrc/paged_extend_bf16_products.c (torch's bf16 attention, vLLM's AMX kernel): the scaled query and the
 * softmax numerators rounded to bf16 for the products, sums and softmax in fp32, each row divided
 * by the sum of the rounded numerators; V products of tokens 2m and 2m + 1 summed in one step
 * (pages of an odd size: one token at a time), so the bits do not depend on where the pages
 * lie; VDPBF16PS treats subnormal inputs and results as zero (MXCSR aside), as AMX's TDPBF16PS
 * does. The GQA path (D = 64 or 128) only; other head sizes take
 * qw_paged_decode_bf16's fp32 products inside the same call, as does a build without AVX512_BF16
 * (the whole call). */
#if defined(QW_AVX512) && defined(__AVX512BF16__) && !defined(QW_NO_DECODE_DP) /* -D for A/B runs */
#define QW_DECODE_DP 1
#endif
#ifdef QW_DECODE_DP
/* the scores on AMX tiles where the build has them (paged_decode_amx.h): the avx512 build of an
 * AMX CPU, or of an AVX512_BF16 one with the tiles emulated (QW_AMX_EMULATE, tests only) */
#if defined(QW_GEMM_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && !defined(QW_NO_DECODE_AMX)
#define QW_DECODE_AMX 1
#endif
#define QW_DP 1
#define KV_T uint16_t
#ifdef QW_DECODE_AMX
int qw_gemm_bf16_amx_ready(void);
#include "paged_decode_amx.h"
#endif
#define LOAD8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define LOAD1(p) qw_bf16_to_f32(*(p))
#define FN(name) QW_CAT(name, bf16_dp)
#include "paged_decode_impl.h"
#undef KV_T
#undef LOAD8
#undef LOAD16
#undef LOAD1
#undef FN
#undef QW_DP
#else
int qw_paged_decode_bf16_dp(const float *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, float *out,
                            int64_t out_stride, int B, int Hq, int Hkv, int D, int block_size, float scale, int num_threads,
                            int64_t num_blocks, int window, float softcap, const float *sinks) {
    return qw_paged_decode_bf16(q, q_stride, k_cache, v_cache, block_tables, table_stride, seq_lens, out, out_stride, B,
                                Hq, Hkv, D, block_size, scale, num_threads, num_blocks, window, softcap, sinks);
}
#endif

/* Which products qw_paged_decode_bf16_dp's items of this shape run: 2 scores on AMX tiles
 * (paged_decode_amx.h), 1 AVX512_BF16 dot products, 0 neither (the fp32-product kernel). */
int qw_paged_decode_bf16_dp_kernel(int D, int G, int block_size) {
#ifdef QW_DECODE_AMX
    if (qw_decode_amx_applies(D, G, block_size)) return 2;
#endif
#ifdef QW_DECODE_DP
    (void)G, (void)block_size;
    return D == 64 || D == 128;
#else
    (void)D, (void)G, (void)block_size;
    return 0;
#endif
}

