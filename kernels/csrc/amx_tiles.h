/* The AMX tile set-up shared by csrc/gemm_amx.c and csrc/paged_extend_bf16_products.c. Include it
 * only where the AMX intrinsics are compiled (after immintrin.h). */
#pragma once
#include <stdint.h>
#ifdef QW_AMX_EMULATE
#include "amx_emulate.h"
#endif

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} qw_tile_config;

/* all eight tiles 16 rows x 64 bytes: C (fp32 16 x 16), A (bf16 16 x 32), B (16 k pairs x 16
 * columns). A constant in memory: gcc does not see that LDTILECFG reads its operand, and dropped
 * the stores of a configuration built on the stack (found when the function was not inlined: a
 * garbage configuration, #GP, a segfault) */
static const qw_tile_config QW_TILES_16x64 __attribute__((aligned(64))) = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static inline void qw_configure_tiles(void) { _tile_loadconfig(&QW_TILES_16x64); }

/* gcc 12's tile intrinsics do not declare the memory they touch (TILESTORED's writes, TILELOADD's
 * reads): after the stores, a barrier, so that the sums are read back only once written */
#define TILES_STORED() __asm__ volatile("" ::: "memory")
