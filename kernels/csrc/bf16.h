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

#endif
