"""Triton fused mixture-of-experts: a grouped GEMM over the experts in two launches.

Same contract as :func:`kernels.moe_reference.moe_experts_ref` (read its docstring for the shapes).

The ``T * K`` (token, expert) pairs are sorted by expert and each expert's group padded to a
multiple of ``BLOCK_M`` (:func:`kernels.moe_reference.moe_align`, torch, no host sync), so every
``BLOCK_M``-row tile belongs to one expert. Then:

1. ``_gate_up_kernel``, one program per (tile, ``BLOCK_N`` columns of ``I``): gathers the tile's
   token rows of ``x``, multiplies them by that expert's gate and up rows (two accumulators over
   the same ``x`` tile) and writes ``silu(gate) * up`` to row ``t * K + k`` of an ``[T*K, I]``
   buffer: the SwiGLU is fused, the ``[T*K, 2I]`` projection never reaches memory.
2. ``_down_kernel``, one program per (tile, ``BLOCK_N`` columns of ``H``): the tile's rows of that
   buffer times the expert's down projection, scaled by the routing weight, to row ``t * K + k``
   of ``[T*K, H]``; the ``K`` rows of a token are then summed (deterministic, no atomics).

Weights are read as stored, ``[E, out, in]``, by expert id: no per-step copies. Tiles past the
last expert's group (the grid is a worst-case bound) return at once. Intermediate values are
rounded to the activation dtype where transformers' eager loop rounds them (the gate and up
projections, the SiLU, the product, the down projection), so bf16 results track it closely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contracts import require
from .moe_reference import moe_align


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr,
    M, H, I,
    stride_xt, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = ids < M
    tok = (ids // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
    # [BLOCK_K, BLOCK_N] views of the expert's gate rows and up rows (row-major [2I, H])
    g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + I * stride_wn
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_K:  # no mask along the contiguous dimension: vectorised, asynchronous copies
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            g = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < H
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dt = out_ptr.dtype.element_ty
    # rounded where F.linear, F.silu and the product round in the eager reference
    gate = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)
    h = (act * up).to(dt)
    o_ptrs = out_ptr + ids[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, h, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, topk_w_ptr,
    M, H, I,
    stride_hm, stride_we, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, W_IN_ACT: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = ids < M
    rows = ids.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows[:, None] * stride_hm + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k + k0 < I
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dt = out_ptr.dtype.element_ty
    weight = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0)
    if W_IN_ACT:
        weight = weight.to(dt).to(tl.float32)
    y = acc.to(dt).to(tl.float32) * weight[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, y.to(dt), mask=row_ok[:, None] & n_ok[None, :])


def _block_m(pairs: int, num_experts: int) -> int:
    """Rows per tile: 16 (tl.dot's minimum) while experts see few tokens (decode), larger tiles
    once the average group fills them (prefill)."""
    per_expert = pairs / num_experts
    return 64 if per_expert >= 48 else 32 if per_expert >= 24 else 16


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights_in_act_dtype: bool = False,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Triton version of :func:`kernels.moe_reference.moe_experts_ref`. Block sizes may be forced
    (tests use small ones to cross tile boundaries on tiny shapes)."""
    T, H = x.shape
    E, two_i, _ = gate_up.shape
    I = two_i // 2
    K = topk_ids.shape[1]
    M = T * K
    if T == 0:
        return torch.zeros_like(x)
    assert x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1
    assert gate_up.dtype == down.dtype == x.dtype, "activations and expert weights share one dtype"
    require(gate_up.shape == (E, 2 * I, H) and two_i % 2 == 0, f"gate_up has shape {tuple(gate_up.shape)}, expected ({E}, 2 * I, {H})")
    require(down.shape == (E, H, I), f"down has shape {tuple(down.shape)}, expected ({E}, {H}, {I})")
    require(topk_ids.shape == topk_weights.shape == (T, K), f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)}, expected ({T}, {K})")
    bm = block_m or _block_m(M, E)
    bn = block_n or 64
    bk = block_k or (32 if x.dtype == torch.float32 else 64)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    sorted_ids, block_expert = moe_align(topk_ids, E, bm)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    num_blocks = block_expert.numel()
    h = torch.empty((M, I), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(I, bn))](
        x, gate_up, h, sorted_ids, block_expert,
        M, H, I,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), h.stride(0),
        TOP_K=K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec, EVEN_K=H % bk == 0, num_warps=4,
    )
    y = torch.empty((M, H), dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(H, bn))](
        h, down, y, sorted_ids, block_expert, weights,
        M, H, I,
        h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC=prec, W_IN_ACT=weights_in_act_dtype, EVEN_K=I % bk == 0,
        num_warps=4,
    )
    return y.view(T, K, H).sum(dim=1)


__all__ = ["moe_experts"]
