/* AMX in software, for testing the AMX kernels on CPUs without AMX (QW_AMX_EMULATE: set by
 * QWORKER_CPU_AMX_EMULATE=1, kernels/cpu.py; never in a serving build: a tile product here costs
 * thousands of scalar operations). Included by amx_tiles.h after immintrin.h, it replaces the tile
 * intrinsics the kernels use with functions on a per-thread tile state, keeping what the hardware
 * enforces, so that a kernel that would fault on AMX aborts here instead of passing:
 *   - every tile operation needs a loaded configuration (palette 1) and configured tiles (#UD else);
 *   - TILELOADD/TILESTORED move rows[t] rows of colsb[t] bytes, rows `stride` bytes apart; a load
 *     zeroes the rest of the tile;
 *   - TDPBF16PS checks the shapes as the SDM lists them (dst.rows == a.rows, a.colsb / 4 ==
 *     b.rows, dst.colsb == b.colsb, all colsb multiples of 4, three distinct tiles) and computes,
 *     for each dst row m and k pair: dst[m][n] += a[m][2k] * b[k][2n], then += a[m][2k+1] * b[k][2n+1],
 *     in fp32, round to nearest even, input denormals as zero, output denormals flushed.
 * The hardware's accumulation may round differently: tests compare against oracles with
 * tolerances, never the emulation's bits against the hardware's. What it cannot catch: compiler
 * defects around the real intrinsics (gcc dropping a configuration's stores, a missing store
 * barrier: the emulated operations are plain C the compiler sees through), and speed. */
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int configured;
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16][64];
} qw_emu_tiles;

/* one tile state per thread, shared by every source file (weak: the linker keeps one) */
__attribute__((weak)) __thread qw_emu_tiles qw_emu;

static inline __attribute__((noreturn)) void qw_emu_fault(const char *what, int t) {
    fprintf(stderr, "qworker AMX emulation: %s (tile %d): the hardware would fault\n", what, t);
    abort();
}

static inline void qw_emu_check(int t) {
    if (!qw_emu.configured) qw_emu_fault("tile instruction without a loaded configuration", t);
    if (t < 0 || t > 7) qw_emu_fault("no such tile", t);
    if (!qw_emu.rows[t] || !qw_emu.colsb[t]) qw_emu_fault("tile not configured", t);
}

/* the 64-byte configuration: palette at byte 0, start_row at 1, colsb[16] (uint16) from byte 16,
 * rows[16] from byte 48; read as bytes, not through the kernels' struct under test */
static inline void qw_emu_loadconfig(const void *config) {
    const uint8_t *c = config;
    if (c[0] == 0) { /* palette 0: the init state */
        memset(&qw_emu, 0, sizeof qw_emu);
        return;
    }
    if (c[0] != 1 || c[1] != 0) qw_emu_fault("palette must be 1 with start_row 0", -1);
    for (int i = 2; i < 16; i++)
        if (c[i]) qw_emu_fault("reserved configuration bytes must be zero", -1);
    memset(&qw_emu, 0, sizeof qw_emu);
    for (int t = 0; t < 16; t++) {
        const uint16_t colsb = (uint16_t)(c[16 + 2 * t] | c[17 + 2 * t] << 8);
        const uint8_t rows = c[48 + t];
        if (t >= 8 ? colsb || rows : colsb > 64 || rows > 16 || (!colsb) != (!rows)) qw_emu_fault("invalid tile shape", t);
        if (t < 8) qw_emu.colsb[t] = colsb, qw_emu.rows[t] = rows;
    }
    qw_emu.configured = 1;
}

static inline void qw_emu_release(void) { memset(&qw_emu, 0, sizeof qw_emu); }

static inline void qw_emu_zero(int t) {
    qw_emu_check(t);
    memset(qw_emu.data[t], 0, sizeof qw_emu.data[t]);
}

static inline void qw_emu_load(int t, const void *base, long stride) {
    qw_emu_check(t);
    memset(qw_emu.data[t], 0, sizeof qw_emu.data[t]);
    for (int r = 0; r < qw_emu.rows[t]; r++) memcpy(qw_emu.data[t][r], (const char *)base + r * stride, qw_emu.colsb[t]);
}

static inline void qw_emu_store(int t, void *base, long stride) {
    qw_emu_check(t);
    for (int r = 0; r < qw_emu.rows[t]; r++) memcpy((char *)base + r * stride, qw_emu.data[t][r], qw_emu.colsb[t]);
}

static inline float qw_emu_bf16(const uint8_t *p) { /* denormal inputs read as zero */
    uint32_t bits = (uint32_t)(p[0] | p[1] << 8) << 16;
    if (!(bits & 0x7f800000u)) bits &= 0x80000000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float qw_emu_flush(float x) { /* denormal outputs flushed to (signed) zero */
    return __builtin_fabsf(x) < 0x1p-126f ? __builtin_copysignf(0.0f, x) : x;
}

static inline void qw_emu_dpbf16ps(int c, int a, int b) {
    qw_emu_check(c), qw_emu_check(a), qw_emu_check(b);
    if (c == a || c == b || a == b) qw_emu_fault("TDPBF16PS needs three distinct tiles", c);
    if (qw_emu.colsb[c] % 4 || qw_emu.colsb[a] % 4 || qw_emu.colsb[b] % 4 || qw_emu.rows[c] != qw_emu.rows[a] ||
        qw_emu.colsb[a] / 4 != qw_emu.rows[b] || qw_emu.colsb[c] != qw_emu.colsb[b])
        qw_emu_fault("TDPBF16PS tile shapes do not fit", c);
    const int M = qw_emu.rows[c], K = qw_emu.colsb[a] / 4, N = qw_emu.colsb[c] / 4;
    float bf[16][2][16]; /* b's k pair (j = 0, 1) by column, widened once */
    for (int k = 0; k < K; k++)
        for (int n = 0; n < N; n++)
            for (int j = 0; j < 2; j++) bf[k][j][n] = qw_emu_bf16(&qw_emu.data[b][k][4 * n + 2 * j]);
    for (int m = 0; m < M; m++) {
        float dst[16];
        memcpy(dst, qw_emu.data[c][m], sizeof dst);
        for (int k = 0; k < K; k++) {
            const float a0 = qw_emu_bf16(&qw_emu.data[a][m][4 * k]), a1 = qw_emu_bf16(&qw_emu.data[a][m][4 * k + 2]);
            /* a product of two bf16 values is exact in fp32 (unless it under- or overflows), so
             * whether the compiler fuses it into the add changes nothing in the normal range */
            for (int n = 0; n < N; n++) dst[n] = qw_emu_flush(qw_emu_flush(dst[n] + a0 * bf[k][0][n]) + a1 * bf[k][1][n]);
        }
        memcpy(qw_emu.data[c][m], dst, (size_t)N * 4);
    }
}

#undef _tile_loadd
#undef _tile_stream_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) qw_emu_loadconfig(config)
#define _tile_release() qw_emu_release()
#define _tile_zero(t) qw_emu_zero(t)
#define _tile_loadd(t, base, stride) qw_emu_load(t, base, stride)
#define _tile_stream_loadd(t, base, stride) qw_emu_load(t, base, stride)
#define _tile_stored(t, base, stride) qw_emu_store(t, base, stride)
#define _tile_dpbf16ps(c, a, b) qw_emu_dpbf16ps(c, a, b)
