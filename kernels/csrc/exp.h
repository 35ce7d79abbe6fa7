/* Shared by the CPU kernels: a vectorisable exp for non-positive arguments. */
#pragma once
#include <stdint.h>

/* exp(x) for x <= 0 (softmax arguments after subtracting the max), ~1 ulp-level accuracy in the
 * range that matters, written with plain arithmetic so that the compiler vectorises the loop that
 * calls it (libm's expf is only vectorised under -ffast-math, which we avoid because it changes
 * the floating-point environment of the whole process). */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;                 /* e^-87 ~ 1.6e-38: still a normal float */
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    float k = __builtin_floorf(x * log2e + 0.5f);
    float r = x - k * ln2_hi - k * ln2_lo;       /* |r| <= ln2 / 2 */
    /* minimax polynomial for e^r on [-ln2/2, ln2/2] (Cephes expf coefficients) */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale2k;
    scale2k.i = ((int32_t)k + 127) << 23;       /* 2^k, k in [-126, 0] */
    return p * scale2k.f;
}

/* scores[t] = scale * q . k_t for n <= 8 consecutive tokens of one block (k rows token_stride
 * apart). D is a multiple of 8. */
