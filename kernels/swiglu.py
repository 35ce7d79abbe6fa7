"""Triton SwiGLU of a fused gate/up projection: ``silu(gate) * up``, one pass.

Same contract and rounding as :func:`kernels.reference.silu_and_mul_ref`: silu computed in
fp32 and rounded to the input's dtype, then the product rounded. It replaces two launches
and an intermediate tensor (silu, then multiply) with one; on a GPU decode step, bound by
the host's launches, that is what counts (``bench/gpu_step_trace.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`kernels.reference.silu_and_mul_ref`: ``[..., 2I]`` -> ``[..., I]``."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul: the last dimension ({two_i}) must hold gate and up halves of equal width")
    x = gate_up.reshape(-1, two_i)
    if x.stride(-1) != 1:
        x = x.contiguous()
    width = two_i // 2
    out = torch.empty((x.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    if x.shape[0] and width:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(width, block))](
            x, out, x.stride(0), out.stride(0), width, BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], width)


__all__ = ["silu_and_mul"]
