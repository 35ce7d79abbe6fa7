/* bf16 <-> fp32 for the C kernels that read or write bf16 activations (elementwise.c,
 * decoder_layers.c). */
#ifndef QW_BF16_H
#define QW_BF16_H

#include <stdint.h>
#include <string.h>

/* fp32 -> bf16, rounded to nearest even as torch's .to(torch.bfloat16); NaN -> 0x7fc0 (torch's
 * scalar conversion; its vectorised one writes 0xffff) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* bf16 -> fp32 is exact: the bf16 bits are the fp32's upper half */
static inline float bf16_to_f32(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* finite fp32 rounded to bf16 precision, nearest even (as f32_to_bf16); the bf16 bits are each
 * lane's upper half, the lower half zero */
static inline __m512i round_bf16_16(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_and_si512(up, _mm512_set1_epi32((int)0xffff0000u));
}

/* The lanes of v selected by m into row y: fp32 (ybf 0), or bf16 rounded as f32_to_bf16 does,
 * 16 at a time (ybf 1). */
static inline void store16_f32_or_bf16(void *y, int ybf, __m512 v, __mmask16 m) {
    if (!ybf) {
        _mm512_mask_storeu_ps((float *)y, m, v);
        return;
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
    _mm256_mask_storeu_epi16((uint16_t *)y, m, _mm512_cvtepi32_epi16(r));
}
#endif

#endif
