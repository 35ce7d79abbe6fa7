"""Triton fused residual-add + RMSNorm, one program per row.

Same contract and rounding order as :func:`kernels.reference.rms_norm_ref`
(HF Llama's): ``h = x + residual`` rounded to the input dtype, the mean of
squares in fp32 from that rounded ``h``, the normalized row cast to the input
dtype, then multiplied by ``weight``. One pass reads x (and residual) once and
writes out (and the new residual) once, instead of the 4-5 passes of eager torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contracts import require


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_r, stride_o, stride_nr,
    eps, N,
    N_PAD: tl.constexpr, HAS_RES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, N_PAD)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_nr + offs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, 0) / N
    normed = (h * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of :func:`kernels.reference.rms_norm_ref`: returns ``(out, new_residual)``."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    require(weight.shape == (N,), f"weight has shape {tuple(weight.shape)}, expected ({N},)")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if residual is None:
        res2, new_res = x2, x  # unused by the kernel
    else:
        require(residual.shape == x.shape and residual.dtype == x.dtype,
                f"residual is {tuple(residual.shape)} {residual.dtype}, x {tuple(x.shape)} {x.dtype}")
        res2 = residual.reshape(-1, N)
        require(res2.stride(-1) == 1, "residual's last dim must be contiguous")
        new_res = torch.empty_like(x2)
    rows = x2.shape[0]
    if rows:
        _rms_norm_kernel[(rows,)](
            x2, res2, weight, out, new_res,
            x2.stride(0), res2.stride(0), out.stride(0), new_res.stride(0) if residual is not None else 0,
            eps, N,
            N_PAD=triton.next_power_of_2(N), HAS_RES=residual is not None,
            num_warps=4 if N <= 4096 else 8,
        )
    new_res = new_res if residual is None else new_res.view(x.shape)
    return out.view(x.shape), new_res


__all__ = ["rms_norm"]
