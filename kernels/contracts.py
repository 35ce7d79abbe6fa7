"""Input checks the Triton wrappers share.

A kernel trusts its pointers and the strides it is given: a buffer of the wrong shape, or an index
tensor whose layout is not the one the kernel assumes, is read or written out of bounds in
silence (wrong numbers, or a corrupted heap). So each wrapper checks shapes, dtypes and layouts
first and raises ``KernelInputError`` naming the argument. The checks read tensor metadata only:
no device synchronisation, a few microseconds per call, and CUDA-graph capture stays possible.
The *values* inside index tensors (block ids, slots, segment bounds, expert ids) stay the
caller's contract where checking them would need a synchronisation.
"""

from __future__ import annotations

import torch


class KernelInputError(ValueError):
    """An argument a kernel cannot take as given."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise KernelInputError(message)


def check_out(out: torch.Tensor, like: torch.Tensor, name: str = "out") -> None:
    """``out`` is written in place: ``like``'s shape and dtype, its last dim contiguous."""
    require(out.shape == like.shape, f"{name} has shape {tuple(out.shape)}, expected {tuple(like.shape)}")
    require(out.dtype == like.dtype, f"{name} is {out.dtype}, expected {like.dtype}")
    require(out.stride(-1) == 1, f"{name}'s last dim must be contiguous (stride {out.stride(-1)})")


def check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The attention kernels read q and both caches in one dtype (``tl.dot`` takes no mix)."""
    require(k_cache.dtype == v_cache.dtype == q.dtype, f"q is {q.dtype}, the cache {k_cache.dtype}/{v_cache.dtype}: one dtype")


def check_vector(t: torch.Tensor, name: str, length: int, dtype: torch.dtype | None = None) -> None:
    """A per-sequence, per-token or per-head tensor the kernel reads as ``ptr + i`` (of ``dtype``
    where given: attention sinks are read as fp32)."""
    require(t.dim() == 1 and t.numel() == length, f"{name} has shape {tuple(t.shape)}, expected ({length},)")
    require(t.is_contiguous(), f"{name} must be contiguous")
    require(dtype is None or t.dtype == dtype, f"{name} is {t.dtype}, expected {dtype}")


def check_block_tables(block_tables: torch.Tensor, batch: int) -> None:
    """``[B, max_blocks]``, read as ``ptr + b * stride(0) + i``."""
    require(block_tables.dim() == 2 and block_tables.shape[0] == batch,
            f"block_tables has shape {tuple(block_tables.shape)}, expected ({batch}, max_blocks)")
    require(block_tables.stride(1) == 1, f"block_tables' rows must be contiguous (stride {block_tables.stride(1)})")
