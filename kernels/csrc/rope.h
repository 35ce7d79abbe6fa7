/* Rotary embedding (rotate-half convention) of one pair of a head's values, shared by
 * csrc/elementwise.c's qw_rope_f32 and the bf16 layer loop's fused rotary + KV write
 * (csrc/decoder_layers.c), so that both compute the same bits. x1 = x[i], x2 = x[i + D / 2];
 * c and s: the position's cos/sin tables (both halves equal). */
#pragma once

static inline void rope_pair(float x1, float x2, const float *restrict c, const float *restrict s, int i, int half,
                             float *restrict o1, float *restrict o2) {
    *o1 = x1 * c[i] - x2 * s[i];
    *o2 = x2 * c[i + half] + x1 * s[i + half];
}
