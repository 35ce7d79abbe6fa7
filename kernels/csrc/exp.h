/* Shared by the CPU kernels: a vectorisable exp for non-positive arguments. */
#pragma once
#include <stdint.h>

/* exp(x) for x <= 0 (softmax arguments after subtracting the max), ~1 ulp-level accuracy in the
 * range that matters, written with plain arithmetic so that the compiler vectorises the loop that
 * calls it (libm's expf is only vectorised under -ffast-math, which we avoid because it changes
 * the floating-point environment of the whole process). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;                /* e^-87 ~ 1.6e-38: still a normal float */
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    /* k = floor(x * log2e + 0.5): the argument is >= -126, so truncating it shifted by +126 is
     * the floor (floorf itself keeps gcc from vectorising the loop without -ffast-math) */
    const int32_t ki = (int32_t)(x * log2e + 0.5f + 126.0f) - 126;
    const float k = (float)ki;
    float r = x - k * ln2_hi - k * ln2_lo;       /* |r| <= ln2 / 2 */
    /* minimax polynomial for e^r on [-ln2/2, ln2/2] (Cephes expf coefficients) */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = (ki + 127) << 23; /* 2^k, k in [-126, 0] */
    float scale2k;
    __builtin_memcpy(&scale2k, &bits, sizeof scale2k);
    return p * scale2k;
}

/* Gemma 2's soft-cap, for the decode and extend kernels alike.
 * cap * tanh(x / cap) from one exp of a non-positive argument: vectorisable (tanhf is not without
 * -ffast-math) and finite for any x; the absolute error stays at fp32 rounding level. */
static inline float qw_softcap(float x, float cap) {
    const float y = x / cap;
    const float e = exp_nonpositive(-2.0f * (y < 0.0f ? -y : y));
    const float t = (1.0f - e) / (1.0f + e);
    return cap * (y < 0.0f ? -t : t);
}


#if defined(__AVX512F__)
#include <immintrin.h>
/* exp_nonpositive on 16 lanes, the same steps (the vector kernels' softmax, x <= 0) */
static inline __m512 exp_nonpositive16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512i ki = _mm512_sub_epi32(
        _mm512_cvttps_epi32(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f + 126.0f))),
        _mm512_set1_epi32(126));
    const __m512 k = _mm512_cvtepi32_ps(ki);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(ki, _mm512_set1_epi32(127)), 23));
    return _mm512_mul_ps(p, scale);
}
#endif
