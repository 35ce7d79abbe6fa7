/* SiLU-and-multiply (SwiGLU's activation) for one element, shared by csrc/elementwise.c's
 * qw_silu_mul_* and the AMX GEMM's fused gate/up epilogue (csrc/gemm_amx.c), so that the fused and
 * the separate paths compute the same bits. */
#pragma once
#include <math.h>

#include "exp.h"

/* sigmoid(x) from e = e^-|x| and r = 1 / (1 + e): e * r for x < 0, and 0 below -87, where
 * exp_nonpositive stops at e^-87 (a finite gate of -3e38 would otherwise give about -5, and -inf
 * a -inf where x * sigmoid(x) is NaN, as torch has it). */
static inline float sigmoid_from(float x, float e, float r) {
    return x < 0.0f ? (x < -87.0f ? 0.0f : e * r) : r;
}

/* silu(g) * u = g * sigmoid(g) * u, the exponential always taken of a non-positive argument so
 * that it cannot overflow */
static inline float silu_mul(float g, float u) {
    const float e = exp_nonpositive(-fabsf(g)); /* e^-|g| */
    const float r = 1.0f / (1.0f + e);          /* sigmoid(|g|) */
    return g * sigmoid_from(g, e, r) * u;
}
