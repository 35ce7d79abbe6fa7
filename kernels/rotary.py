"""Triton rotary position embedding, in place on q and k, one program per token.

Same contract and rounding as :func:`kernels.reference.rotary_embedding_ref` (HF Llama's
rotate-half): ``x * cos + rotate_half(x) * sin`` with each product and the sum rounded to
x's dtype. Products of two 16-bit floats are exact in fp32, so rounding the fp32 product
gives what torch's 16-bit multiply gives; for fp32 the kernel is compiled without FMA
contraction, so it rounds the products as torch's separate ops do.

Why a kernel: the torch reference is ~10 launches per layer (two table gathers, then a
negate, a concatenation, two multiplies, an add and a copy for each of q and k). On a GPU
decode step, which is bound by the host's launches (``bench/gpu_step_trace.py``: the device
was busy 8% of a step at batch 16), that was a third of all launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, t, heads, c1, c2, s1, s2,
                  HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr, ROUND: tl.constexpr):
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < heads) & (d < HALF)
    first = x_ptr + t * stride_t + h * stride_h + d
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    # out1 = x1*cos1 + (-x2)*sin1, out2 = x2*cos2 + x1*sin2, each product rounded as torch does
    p1, q1 = a1 * c1, -a2 * s1
    p2, q2 = a2 * c2, a1 * s2
    if ROUND:
        p1, q1 = p1.to(dt).to(tl.float32), q1.to(dt).to(tl.float32)
        p2, q2 = p2.to(dt).to(tl.float32), q2.to(dt).to(tl.float32)
    tl.store(first, (p1 + q1).to(dt), mask=mask)
    tl.store(first + HALF, (p2 + q2).to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_table,
    q_heads, k_heads,
    HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr, ROUND: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF_PAD)[None, :]
    dmask = d < HALF
    row = pos * stride_table + d
    c1 = tl.load(cos_ptr + row, mask=dmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row + HALF, mask=dmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row, mask=dmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row + HALF, mask=dmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, q_heads, c1, c2, s1, s2, HALF, H_PAD, HALF_PAD, ROUND)
    _rotate_heads(k_ptr, stride_kt, stride_kh, t, k_heads, c1, c2, s1, s2, HALF, H_PAD, HALF_PAD, ROUND)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Triton version of :func:`kernels.reference.rotary_embedding_ref`, in place on
    ``q [T, Hq, D]`` and ``k [T, Hk, D]``. They may be strided views (a fused qkv output, or the
    first ``D`` channels of wider heads) as long as the channels are contiguous."""
    T, q_heads, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or positions.shape != (T,):
        raise ValueError(f"rotary_embedding: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)} disagree")
    if D % 2 or q.stride(2) != 1 or k.stride(2) != 1 or q.dtype != k.dtype:
        raise ValueError("rotary_embedding: q and k need an even head size, contiguous channels and one dtype")
    if cos.shape != sin.shape or cos.shape[1] != D or cos.stride(1) != 1 or sin.stride() != cos.stride() or cos.dtype != q.dtype:
        raise ValueError(f"rotary_embedding: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} {cos.dtype} tables do not fit"
                         f" head size {D} in {q.dtype}")
    if T == 0:
        return
    positions = positions.contiguous()  # the kernel reads positions[t] at pos_ptr + t
    k_heads = k.shape[1]
    half = D // 2
    _rotary_kernel[(T,)](
        positions, q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        q_heads, k_heads,
        HALF=half, H_PAD=triton.next_power_of_2(max(q_heads, k_heads)), HALF_PAD=triton.next_power_of_2(half),
        ROUND=q.dtype != torch.float32,
        num_warps=4, enable_fp_fusion=False,
    )


__all__ = ["rotary_embedding"]
