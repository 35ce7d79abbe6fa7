/* The work list of the extend (prefill) kernels, shared by csrc/paged_extend.c (fp32 arithmetic)
 * and csrc/paged_extend_bf16_products.c (bf16 products): both split a step's query rows the same
 * way and check the same inputs before reading anything. */
#pragma once
#include <math.h>
#include <stdint.h>

/* One work item: sequence b, KV head h, query rows [i0, i1) of the sequence's chunk. */
typedef struct {
    int64_t cost; /* rows x keys they see: items run most costly first */
    int b, h, i0, i1;
} qw_x_item;

/* Query rows per item for G query heads per KV head: about 128 rows of the block, at least 8
 * queries (both kernels split a step the same way). */
static inline int qw_x_rows_per_item(int G) { return 128 / G < 8 ? 8 : 128 / G; }

/* Checks the inputs (-2: a block-table entry the kernel would read is outside [0, num_blocks), or
 * a sequence has more query rows than tokens) and lists the items, tm query rows each, most costly
 * first, in *items (malloc'd; the caller frees it). Returns the number of items (0: nothing to do,
 * *items NULL), -1 when the list could not be allocated, -2 as above. */
int64_t qw_x_plan(int B, int Hkv, int tm, int block_size, int window, int64_t num_blocks, const int32_t *block_tables,
                  int64_t table_stride, const int32_t *query_start_loc, const int32_t *seq_lens, qw_x_item **items);

/* Query head qh's attention sink term for a row whose running max is m: exp(sink - m), one more
 * numerator in the row's softmax denominator with no value (gpt-oss); 0 without sinks (NULL). */
static inline float qw_x_sink_term(const float *sinks, int qh, float m) {
    return sinks ? expf(sinks[qh] - m) : 0.0f;
}

/* The keys an item reads: query rows [i0, i1) at positions prefix + i see keys [kmin, kend) (kmin
 * > 0 only under a window: a query at p sees (p - window, p]). */
static inline void qw_x_keys(int prefix, int i0, int i1, int window, int *kmin, int *kend) {
    const int p_first = prefix + i0;
    *kmin = window > 0 && p_first - window + 1 > 0 ? p_first - window + 1 : 0;
    *kend = prefix + i1;
}

/* Chunk [c0, c0 + nk) of such an item: the keys of it that are read, [*a, *e) (a window's first
 * chunk starts mid-way), and the rows that see any of them, [*ilo, *ihi): position >= a and, under
 * a window, position - window < e - 1. Returns 0 when no row does (the chunk is skipped). */
static inline int qw_x_chunk(int c0, int nk, int kmin, int kend, int prefix, int i0, int i1, int window, int *a, int *e,
                             int *ilo, int *ihi) {
    *a = c0 > kmin ? c0 : kmin;
    *e = c0 + nk < kend ? c0 + nk : kend;
    *ilo = *a - prefix > i0 ? *a - prefix : i0;
    *ihi = i1;
    /* in int64: a window past int32 arrives as INT_MAX (no window) */
    if (window > 0 && (int64_t)*e - 1 + window - prefix < *ihi) *ihi = *e - 1 + window - prefix;
    return *ilo < *ihi;
}
