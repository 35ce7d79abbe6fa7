"""Triton multi-LoRA shrink and expand over a batch's adapter segments (SGMV, punica style).

Same contracts as :func:`kernels.lora_reference.lora_shrink_ref` and
:func:`~kernels.lora_reference.lora_expand_ref` (read that module's docstring for the segment and
weight-stack layouts).

The grid is (token tile, output tile[, K split]). Token tiles come from
:func:`kernels.lora_reference.lora_tiles`: every ``BLOCK_M``-row tile lies inside one segment, so
its rows share one adapter slot and each program loads that slot's weight tile once for all its
rows (the point of SGMV against a per-token gather). The map is built on the device with no host
synchronisation; its length is a worst-case bound and programs past the last tile return at once,
as do segments of slot ``-1`` (they have no tile). A step builds it once and passes it to every
call (``tiles=``); without it each call builds its own.

* ``_shrink_kernel``: ``h[rows, n0:n0+BN] = x[rows, :] @ A[slot, n0:n0+BN, :].T``, looping over
  ``in`` in ``BLOCK_K`` steps (fp32 accumulation). ``h`` is allocated zeroed, so rows no tile
  covers stay zero. With ``SPLIT_K > 1`` the ``in`` loop is split across programs that add their
  partial sums atomically (more programs for a decode step's few tiles; fp32 addition order then
  varies between runs).
* ``_expand_kernel``: ``y[rows, off+n0 : off+n0+BN] += h[rows, :R] @ B[slot, n0:n0+BN, :].T``;
  ``R <= 64`` fits one ``BLOCK_K`` so there is no loop. ``h`` is read through its row stride (a
  column slice of shrink's output; its columns must be contiguous), B is converted to fp32, ``y`` is read, added to in fp32 and written
  back rounded once to its dtype. Each (row, column) belongs to one program: no atomics.

fp32 operands use IEEE dots (``tf32`` would round them to 10 bits); fp16/bf16 operands use the
tensor cores natively for shrink, and tf32 for expand's fp32 operands when ``y`` is half precision
(its own rounding dominates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contracts import check_vector
from .lora_reference import LoraTiles, lora_tiles


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, tile_seg_ptr, tile_row_ptr,
    K, N,
    stride_xt, stride_as, stride_an, stride_ht,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT_PREC: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    seg = tl.load(tile_seg_ptr + pid_t)
    if seg < 0:
        return
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    offs_m = tl.load(tile_row_ptr + pid_t) + tl.arange(0, BLOCK_M)
    m_ok = offs_m < length
    rows = (start + offs_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    x_rows = x_ptr + rows[:, None] * stride_xt
    # [BLOCK_K, BLOCK_N] view of the slot's A rows (row-major [N, K])
    a_cols = a_ptr + slot * stride_as + offs_n[None, :].to(tl.int64) * stride_an
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:  # no mask along the contiguous dimension: vectorised loads
            xv = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None], other=0.0)
            av = tl.load(a_cols + offs_k[:, None], mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K
            xv = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            av = tl.load(a_cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(xv, av, acc, input_precision=DOT_PREC)
    h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(h_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(h_ptrs, acc, mask=mask, sem="relaxed")


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, y_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, tile_seg_ptr, tile_row_ptr,
    N,
    stride_ht, stride_bs, stride_bn, stride_yt,
    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    seg = tl.load(tile_seg_ptr + pid_t)
    if seg < 0:
        return
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    offs_m = tl.load(tile_row_ptr + pid_t) + tl.arange(0, BLOCK_M)
    m_ok = offs_m < length
    rows = (start + offs_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + rows[:, None] * stride_ht + offs_k[None, :]
    b_ptrs = b_ptr + slot * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    if R == BLOCK_K:  # no mask along the contiguous rank dimension: vectorised loads
        hv = tl.load(h_ptrs, mask=m_ok[:, None], other=0.0)
        bv = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0).to(tl.float32)
    else:  # rank 8 under tl.dot's 16
        k_ok = offs_k < R
        hv = tl.load(h_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        bv = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    delta = tl.dot(hv, bv, input_precision=DOT_PREC)
    y_ptrs = y_ptr + rows[:, None] * stride_yt + offs_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    yv = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (yv + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _pow2_at_least(n: int, lo: int = 16) -> int:
    """tl.dot's dimensions: powers of two, at least 16."""
    return max(lo, triton.next_power_of_2(n))


def default_block_m(num_tokens: int, num_segments: int) -> int:
    """Rows per tile from the mean segment length (known on the host, unlike the longest):
    16 (tl.dot's minimum) for decode's one-row segments, larger once segments fill them."""
    mean = num_tokens / max(1, num_segments)
    return 64 if mean >= 48 else 32 if mean >= 24 else 16


def _tiles(tiles, seg_start, seg_len, seg_slot, num_tokens) -> LoraTiles:
    # the segments' values (slots in range, bounds within the tokens) are the caller's contract:
    # they live on the device, and checking them would synchronise
    for name, t in (("seg_start", seg_start), ("seg_len", seg_len), ("seg_slot", seg_slot)):
        check_vector(t, name, seg_len.numel())
    if tiles is not None:
        return tiles
    return lora_tiles(seg_start, seg_len, seg_slot, num_tokens, default_block_m(num_tokens, seg_len.numel()))


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    *,
    tiles: LoraTiles | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int = 1,
) -> torch.Tensor:
    """``h [T, n*R]`` float32 (zero outside slot >= 0 segments). Block sizes may be forced (tests
    use small ones to cross tile boundaries on tiny shapes); ``split_k`` splits the ``in`` loop."""
    T, K = x.shape
    S, N, K_a = a_stack.shape
    assert K_a == K, f"a_stack's in dimension {K_a} != x's {K}"
    assert a_stack.dtype == x.dtype, "activations and the A stack share one dtype"
    h = torch.zeros((T, N), dtype=torch.float32, device=x.device)
    if T == 0 or seg_len.numel() == 0:
        return h
    if x.stride(1) != 1:
        x = x.contiguous()
    if a_stack.stride(2) != 1:
        a_stack = a_stack.contiguous()
    t = _tiles(tiles, seg_start, seg_len, seg_slot, T)
    if t.tile_seg.numel() == 0:
        return h
    bn = block_n or min(64, _pow2_at_least(N))
    bk = block_k or (32 if x.dtype == torch.float32 else 64)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    grid = (t.tile_seg.numel(), triton.cdiv(N, bn), split_k)
    _shrink_kernel[grid](
        x, a_stack, h, seg_start, seg_len, seg_slot, t.tile_seg, t.tile_row,
        K, N,
        x.stride(0), a_stack.stride(0), a_stack.stride(1), h.stride(0),
        BLOCK_M=t.block_m, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split_k, DOT_PREC=prec,
        EVEN_K=K % (bk * split_k) == 0, num_warps=4,
    )
    return h


def lora_expand(
    h: torch.Tensor,
    b_stack: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    y: torch.Tensor,
    out_offset: int,
    *,
    tiles: LoraTiles | None = None,
    block_n: int | None = None,
) -> None:
    """``y[rows, out_offset:out_offset+out_i] += h_rows @ b_stack[slot].T`` in place, for the
    segments with slot >= 0 (see :mod:`kernels.lora_reference`)."""
    T, R = h.shape
    S, N, R_b = b_stack.shape
    assert R_b == R, f"b_stack's rank dimension {R_b} != h's {R}"
    assert R <= 128, "the rank must fit one BLOCK_K"
    assert y.shape[0] == T and 0 <= out_offset and out_offset + N <= y.shape[1], "y too small for this slice"
    assert y.stride(1) == 1, "y's rows must be contiguous (it is written in place)"
    assert h.dtype == torch.float32, "h is lora_shrink's float32 output (or a slice of it)"
    if T == 0 or seg_len.numel() == 0:
        return
    if b_stack.stride(2) != 1:
        b_stack = b_stack.contiguous()
    if h.stride(1) != 1:
        h = h.contiguous()
    t = _tiles(tiles, seg_start, seg_len, seg_slot, T)
    if t.tile_seg.numel() == 0:
        return
    bn = block_n or 64
    prec = "ieee" if y.dtype == torch.float32 else "tf32"
    grid = (t.tile_seg.numel(), triton.cdiv(N, bn))
    # the slice's own view: its start's alignment (not a runtime offset) is what the launcher sees,
    # so an offset of a multiple of 8 bf16 columns keeps y's loads and stores vectorised
    y_slice = y.narrow(1, out_offset, N)
    _expand_kernel[grid](
        h, b_stack, y_slice, seg_start, seg_len, seg_slot, t.tile_seg, t.tile_row,
        N,
        h.stride(0), b_stack.stride(0), b_stack.stride(1), y.stride(0),
        R=R, BLOCK_M=t.block_m, BLOCK_N=bn, BLOCK_K=_pow2_at_least(R), DOT_PREC=prec, num_warps=4,
    )


__all__ = ["lora_shrink", "lora_expand", "default_block_m"]
