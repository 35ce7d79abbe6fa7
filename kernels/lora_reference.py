"""Multi-LoRA shrink and expand in plain torch: the reference for :mod:`kernels.lora_sgmv`, and the
segment-to-tile map that kernel reads (built here so that it needs torch only).

A batch's tokens are grouped in *segments*: contiguous runs of rows that run under one adapter
slot. ``seg_start``, ``seg_len``, ``seg_slot`` are int32 tensors of one entry per segment, on
the activations' device. Segments are disjoint and lie inside ``[0, T)``; slot ``-1`` is the base
model (no adapter); rows in no segment are allowed (padding).

Weight stacks (one entry per device slot, ``S = max_loras``; ``R`` is the max rank, lower ranks
zero-padded; the LoRA scaling is already folded into B):

* ``a_stack`` ``[S, n*R, in]``: the A matrices of a projection's ``n`` output slices stacked
  along rows (fused qkv: ``n = 3``, gate_up: 2, o/down: 1); slice ``i`` is rows ``i*R:(i+1)*R``.
* ``b_stack`` ``[S, out_i, R]``: one slice's B matrices.

``lora_shrink(x [T, in]) -> h [T, n*R]`` float32: the rows of a segment with slot ``s`` are
``x_rows @ a_stack[s].T`` (fp32 accumulation); rows of slot ``-1`` segments and rows in no
segment are **zero**.

``lora_expand(h [T, R], b_stack, ..., y [T, out_total], out_offset)`` adds, in place, for each
segment with slot ``s >= 0``: ``y[rows, off:off+out_i] += h_rows @ b_stack[s].T``, the product
and the sum in fp32, the sum rounded once to ``y.dtype``. Rows of slot ``-1`` segments, rows in
no segment and the columns outside ``[off, off+out_i)`` are untouched.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def _segments(seg_start: torch.Tensor, seg_len: torch.Tensor, seg_slot: torch.Tensor):
    """(start, length, slot) of the non-empty adapter segments (host lists: the reference syncs)."""
    for start, length, slot in zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist()):
        if slot >= 0 and length > 0:
            yield start, length, slot


def lora_shrink_ref(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
) -> torch.Tensor:
    """``h [T, n*R]`` float32, one segment at a time (see the module docstring)."""
    h = torch.zeros(x.shape[0], a_stack.shape[1], dtype=torch.float32, device=x.device)
    for start, length, slot in _segments(seg_start, seg_len, seg_slot):
        rows = slice(start, start + length)
        h[rows] = x[rows].float() @ a_stack[slot].float().T
    return h


def lora_expand_ref(
    h: torch.Tensor,
    b_stack: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    y: torch.Tensor,
    out_offset: int,
) -> None:
    """In place on ``y``, one segment at a time (see the module docstring)."""
    out = b_stack.shape[1]
    cols = slice(out_offset, out_offset + out)
    for start, length, slot in _segments(seg_start, seg_len, seg_slot):
        rows = slice(start, start + length)
        delta = h[rows].float() @ b_stack[slot].float().T
        y[rows, cols] = (y[rows, cols].float() + delta).to(y.dtype)


class LoraTiles(NamedTuple):
    """Which ``block_m`` rows each kernel program handles, with no host synchronisation.

    ``tile_seg`` int32 ``[num_tiles]``: the segment of each tile, ``-1`` for tiles past the last
    (the grid is a worst-case bound; those programs return at once). ``tile_row`` int32
    ``[num_tiles]``: the tile's first row inside its segment (a multiple of ``block_m``).
    Segments with slot ``-1`` or no rows get no tile.
    """

    tile_seg: torch.Tensor
    tile_row: torch.Tensor
    block_m: int


def lora_tiles(
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    num_tokens: int,
    block_m: int,
) -> LoraTiles:
    """The tile map of a batch (shared by every shrink and expand of a step: build it once).

    A segment of ``L`` rows needs ``cdiv(L, block_m)`` tiles, at most ``L / block_m + 1``; the
    segments are disjoint inside ``[0, num_tokens)``, so ``cdiv(num_tokens, block_m) + G`` tiles
    (``G`` segments) bound the total whatever the split: a decode step of 64 one-row segments
    launches 65 tiles, a 4096-token prefill of one adapter 257.
    """
    G = seg_len.numel()
    dev = seg_len.device
    num_tiles = -(-num_tokens // block_m) + G
    if G == 0 or num_tokens == 0:
        empty = torch.full((0,), -1, dtype=torch.int32, device=dev)
        return LoraTiles(empty, empty, block_m)
    length = seg_len.to(torch.int64).clamp_min(0)
    per_seg = torch.where(seg_slot >= 0, (length + block_m - 1) // block_m, 0)
    ends = torch.cumsum(per_seg, 0)
    tile = torch.arange(num_tiles, device=dev)
    seg = torch.searchsorted(ends, tile, right=True)  # skips segments with no tile
    inside = seg < G
    seg_c = seg.clamp_max(G - 1)
    row = (tile - (ends - per_seg)[seg_c]) * block_m
    tile_seg = torch.where(inside, seg, -1).to(torch.int32)
    tile_row = torch.where(inside, row, 0).to(torch.int32)
    return LoraTiles(tile_seg, tile_row, block_m)


__all__ = ["lora_shrink_ref", "lora_expand_ref", "lora_tiles", "LoraTiles"]
