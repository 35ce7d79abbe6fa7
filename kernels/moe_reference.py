"""Mixture-of-experts in plain torch: the reference for :mod:`kernels.fused_moe`, and the
expert-sorted, block-padded token layout that kernel reads (built here so that it needs torch only).

Shapes (the checkpoint's ``[out, in]`` convention, as transformers stores fused experts):

* ``x`` ``[T, H]``: one row per token.
* ``gate_up`` ``[E, 2I, H]``: per expert, the ``I`` gate rows then the ``I`` up rows.
* ``down`` ``[E, H, I]``.
* ``topk_weights`` ``[T, K]`` fp32 and ``topk_ids`` ``[T, K]`` int: the router's choice per token.

Output ``[T, H]`` in ``x.dtype``: ``sum_k w[t, k] * down[e](silu(gate[e] x_t) * up[e] x_t)`` with
``e = topk_ids[t, k]``. The weight multiplies the fp32 product (or, with
``weights_in_act_dtype``, is first rounded to ``x.dtype``, as Qwen3-MoE and OLMoE do).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_experts_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights_in_act_dtype: bool = False,
) -> torch.Tensor:
    """One expert at a time, in ascending expert id, its tokens gathered, as transformers' eager
    experts loop does (GEMM outputs rounded to ``x.dtype``)."""
    T, H = x.shape
    I = down.shape[2]
    out = torch.zeros_like(x)
    w = topk_weights.to(x.dtype) if weights_in_act_dtype else topk_weights
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.where(topk_ids == e)
        gu = F.linear(x[tok], gate_up[e])
        h = F.silu(gu[:, :I]) * gu[:, I:]
        y = F.linear(h, down[e]) * w[tok, slot, None]
        out.index_add_(0, tok, y.to(x.dtype))
    return out


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs grouped by expert, each expert's group padded to a multiple of
    ``block_m``, with no host synchronisation (the sizes are worst-case bounds, not counts).

    Returns ``(sorted_ids, block_expert)``:

    * ``sorted_ids`` int32 ``[num_blocks * block_m]``: flattened indices ``t * K + k`` into
      ``topk_ids``; within an expert's group in ascending order (a stable sort); padding and the
      unused tail hold ``T * K``, which the kernel masks out.
    * ``block_expert`` int32 ``[num_blocks]``: the expert of each ``block_m``-row block, ``-1`` for
      blocks past the last group (the kernel returns at once for those).

    ``num_blocks = cdiv(T*K + A*(block_m-1), block_m)`` with ``A = min(E, T*K)``, the most experts
    that can be active, bounds the padded total for any routing (a decode step of 8 pairs over 128
    experts launches 8 tiles, not 128).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    M = flat.numel()
    dev = flat.device
    counts = torch.bincount(flat, minlength=num_experts)  # sizes its output by the largest id
    if counts.numel() > num_experts:  # so this check costs no further synchronisation
        raise ValueError(f"an expert id is at least num_experts ({num_experts})")
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    rank = torch.arange(M, device=dev) - start[expert_sorted]  # position within its expert's group
    num_blocks = -(-(M + min(num_experts, M) * (block_m - 1)) // block_m)
    sorted_ids = torch.full((num_blocks * block_m,), M, dtype=torch.int32, device=dev)
    sorted_ids[padded_start[expert_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


__all__ = ["moe_experts_ref", "moe_align"]
