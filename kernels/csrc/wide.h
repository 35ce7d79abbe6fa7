/* QW_WIDE: compile a function's auto-vectorised loops with 512-bit vectors on AVX-512 builds.
 * gcc's -march=native prefers 256-bit vectors on these CPUs (to spare the clock on older parts),
 * which halves the rate of elementwise loops that are bound by arithmetic (SwiGLU's exp, the bf16
 * conversions). Only for loops whose per-element results do not depend on the vector width (no
 * reductions), so every build computes the same bits. */
#pragma once
#if defined(__AVX512F__)
#define QW_WIDE __attribute__((target("prefer-vector-width=512")))
#else
#define QW_WIDE
#endif
