"""The sparse MoE MLP of fp32 panels-packed experts in one C call (``csrc/moe_cpu.c``): the
routed pairs sorted by expert, every active expert's gate_up, SwiGLU and down, the weighted sum
per token, in one OpenMP region. Bit for bit the grouped path of :class:`qworker.model.moe.MoE`
(the same GEMM and SwiGLU code, the same rounding and order), without its ~10 torch calls and two
parallel GEMM calls per active expert.

Usage::

    experts = PackedExperts([gu.weight for gu in gate_ups], [d.weight for d in downs], hidden, intermediate)
    if experts.available():
        out = experts(x, topk_ids, topk_weights)
"""

from __future__ import annotations

import ctypes

import torch

from . import cpu as _cpu
from . import gemm_cpu


class PackedExperts:
    """``E`` experts' panels-packed fp32 weights (``gate_up`` ``[2I, H]``, ``down`` ``[H, I]``, as
    :func:`kernels.gemm_cpu.pack_weight` packs them), held so their addresses stay valid."""

    MAX_TOP_K = 64  # experts per token the kernel takes (csrc/moe_cpu.c sorts each token's pairs on its stack)

    def __init__(self, gate_up: list[torch.Tensor], down: list[torch.Tensor], hidden: int, intermediate: int):
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"{len(gate_up)} gate_up and {len(down)} down weights: one of each per expert")
        self.hidden, self.intermediate = hidden, intermediate
        self._weights = (list(gate_up), list(down))  # the tensors behind the addresses below
        packed = all(w.dtype == torch.float32 and w.is_cpu and w.is_contiguous() and w.dim() == 3 for w in gate_up + down)
        self._gate_up = torch.tensor([w.data_ptr() for w in gate_up], dtype=torch.int64)
        self._down = torch.tensor([w.data_ptr() for w in down], dtype=torch.int64)
        self._packed = packed

    def available(self) -> bool:
        """The C kernel runs these weights here (compiled kernels, fp32 packed weights)."""
        return self._packed and self._fn() is not None

    @staticmethod
    def _fn():
        lib = gemm_cpu._gemm_library(torch.float32)
        return getattr(lib, "qw_moe_f32", None) if lib is not None else None

    @staticmethod
    def _silu_row() -> int | None:
        """The SwiGLU row of the build that runs the other elementwise kernels (the grouped path's
        :func:`kernels.silu_and_mul_cpu`), which the GEMM's build need not be."""
        lib = _cpu._library()
        fn = getattr(lib, "qw_silu_mul_f32_row", None) if lib is not None else None
        return None if fn is None else ctypes.cast(fn, ctypes.c_void_p).value

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 threads: int | None = None) -> torch.Tensor:
        """``x`` fp32 ``[T, H]``, ``topk_ids`` ``[T, K]`` (distinct experts per row), ``topk_weights``
        fp32 ``[T, K]`` -> fp32 ``[T, H]``."""
        T, K = topk_ids.shape
        if x.dtype != torch.float32 or tuple(x.shape) != (T, self.hidden) or topk_weights.shape != topk_ids.shape:
            raise ValueError(f"x {tuple(x.shape)} {x.dtype}, ids {tuple(topk_ids.shape)}, weights {tuple(topk_weights.shape)}: "
                             f"fp32 x of [T, {self.hidden}] and [T, K] ids and weights expected")
        x = x.contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        out = torch.empty((T, self.hidden), dtype=torch.float32)
        rc = self._fn()(x.data_ptr(), T, self.hidden, self.intermediate, len(self._gate_up), K, ids.data_ptr(), weights.data_ptr(),
                        self._gate_up.data_ptr(), self._down.data_ptr(), out.data_ptr(),
                        torch.get_num_threads() if threads is None else int(threads), self._silu_row())
        if rc == -1:
            raise ValueError(f"an expert id outside 0..{len(self._gate_up) - 1}, or top-k {K} outside 1..64")
        if rc != 0:
            raise MemoryError("the MoE kernel could not allocate its scratch memory")
        return out
