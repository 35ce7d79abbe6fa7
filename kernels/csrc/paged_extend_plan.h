/* The work list of the extend (prefill) kernels, shared by csrc/paged_extend.c (fp32 arithmetic)
 * and csrc/paged_extend_bf16_products.c (bf16 products): both split a step's query rows the same
 * way and check the same inputs before reading anything. */
#pragma once
#include <stdint.h>

/* One work item: sequence b, KV head h, query rows [i0, i1) of the sequence's chunk. */
typedef struct {
    int64_t cost; /* rows x keys they see: items run most costly first */
    int b, h, i0, i1;
} qw_x_item;

/* Checks the inputs (-2: a block-table entry the kernel would read is outside [0, num_blocks), or
 * a sequence has more query rows than tokens) and lists the items, tm query rows each, most costly
 * first, in *items (malloc'd; the caller frees it). Returns the number of items (0: nothing to do,
 * *items NULL), -1 when the list could not be allocated, -2 as above. */
int64_t qw_x_plan(int B, int Hkv, int tm, int block_size, int window, int64_t num_blocks, const int32_t *block_tables,
                  int64_t table_stride, const int32_t *query_start_loc, const int32_t *seq_lens, qw_x_item **items);
