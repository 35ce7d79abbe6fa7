"""The device LoRA slots of one projection of one layer.

A projection has ``n`` output slices (fused q/k/v: 3, fused gate/up: 2, o and down: 1), each
the output of one PEFT module. Each of the ``max_loras`` slots holds one adapter's matrices for
them, the scaling already in B. Two layouts, chosen by the model's kernel backend:

* ``"stack"`` (the Triton kernels of :mod:`kernels.lora_sgmv`): ``a_stack [S, n*R, in]`` with
  slice ``i``'s A in rows ``i*R : i*R + r`` and ``b_stacks[i] [S, out_i, R]`` with its B in
  columns ``:r``; ranks below ``R = max_rank`` and modules an adapter does not target are zeros.
* ``"grouped"`` (CPU): per slot, two row-major GEMM operands, the ``x @ w`` layout of
  :class:`~qworker.model.linear.Linear`'s ``"matmul"`` path: ``a_t [in, k]``, the targeted slices'
  A rows concatenated (``k`` the sum of their ranks, no padding), and ``b_t [k, hi - lo]``, their
  B's block-diagonal over the columns ``lo:hi`` that the targeted slices span. A step then costs
  two GEMMs per (slot, projection). Not oneDNN's packed weights: with ``k`` in the tens its
  primitives were 5-10x slower than MKL's ``x @ w`` on the development VM (16 rows: expand to
  960 columns 730 us against 120 us).
  The same matrices also sit in ``pad_a [S, in, K]`` and ``pad_b [S, K, out]`` (``K`` the largest
  ``k`` of the slots, zero-padded, every column): a step whose slots' rows are scattered (decode)
  runs all slots as two batched GEMMs instead of two GEMMs, a gather and a scatter per slot.

``active[s]`` says whether slot ``s`` changes this projection at all: projections that no slot
of a step targets are skipped.
"""

from __future__ import annotations

import torch


class ProjectionSlots:
    __slots__ = ("in_features", "out_slices", "offsets", "max_rank", "layout", "active", "a_stack", "b_stacks", "grouped",
                 "pad_a", "pad_b", "dtype", "device", "max_loras")

    def __init__(self, in_features: int, out_slices: list[int], max_loras: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype, layout: str):
        if layout not in ("stack", "grouped"):
            raise ValueError(f"layout must be 'stack' or 'grouped', got {layout!r}")
        self.in_features = in_features
        self.out_slices = list(out_slices)
        self.offsets = [sum(out_slices[:i]) for i in range(len(out_slices))]
        self.max_rank = max_rank
        self.layout = layout
        self.dtype = dtype
        self.max_loras = max_loras
        self.pad_a: torch.Tensor | None = None
        self.pad_b: torch.Tensor | None = None
        self.device = device
        self.active = [False] * max_loras
        self.a_stack: torch.Tensor | None = None
        self.b_stacks: list[torch.Tensor] = []
        self.grouped: list[tuple[torch.Tensor, torch.Tensor, int, int] | None] = [None] * max_loras
        if layout == "stack":
            n = len(out_slices)
            self.a_stack = torch.zeros(max_loras, n * max_rank, in_features, device=device, dtype=dtype)
            self.b_stacks = [torch.zeros(max_loras, out, max_rank, device=device, dtype=dtype) for out in out_slices]

    @property
    def out_features(self) -> int:
        return sum(self.out_slices)

    def set(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot ``slot`` gets ``pairs[i] = (A [r, in], B [out_i, r])`` per slice (None: untouched
        by the adapter); shapes were checked by the caller."""
        self.active[slot] = any(p is not None for p in pairs)
        if self.layout == "stack":
            self._set_stack(slot, pairs)
        else:
            self._set_grouped(slot, pairs)

    def _set_stack(self, slot: int, pairs) -> None:
        R = self.max_rank
        self.a_stack[slot].zero_()
        for i, p in enumerate(pairs):
            self.b_stacks[i][slot].zero_()
            if p is not None:
                a, b = p
                r = a.shape[0]
                self.a_stack[slot, i * R:i * R + r].copy_(a)
                self.b_stacks[i][slot, :, :r].copy_(b)

    def _set_grouped(self, slot: int, pairs) -> None:
        targeted = [i for i, p in enumerate(pairs) if p is not None]
        if not targeted:
            self.grouped[slot] = None
            self._repad()
            return
        lo = self.offsets[targeted[0]]
        hi = self.offsets[targeted[-1]] + self.out_slices[targeted[-1]]
        a_cat = torch.cat([pairs[i][0] for i in targeted]).to(self.device, self.dtype)
        b_bd = torch.zeros(hi - lo, a_cat.shape[0], device=self.device, dtype=self.dtype)
        col = 0
        for i in targeted:
            b = pairs[i][1]
            row = self.offsets[i] - lo
            b_bd[row:row + b.shape[0], col:col + b.shape[1]] = b
            col += b.shape[1]
        self.grouped[slot] = (a_cat.t().contiguous(), b_bd.t().contiguous(), lo, hi)
        self._repad()

    def _repad(self) -> None:
        """Rebuilds ``pad_a`` / ``pad_b`` from every slot's grouped matrices."""
        live = [g for g in self.grouped if g is not None]
        if not live:
            self.pad_a = self.pad_b = None
            return
        K = max(g[0].shape[1] for g in live)
        pad_a = torch.zeros(self.max_loras, self.in_features, K, device=self.device, dtype=self.dtype)
        pad_b = torch.zeros(self.max_loras, K, self.out_features, device=self.device, dtype=self.dtype)
        for s, g in enumerate(self.grouped):
            if g is not None:
                a_t, b_t, lo, hi = g
                pad_a[s, :, :a_t.shape[1]] = a_t
                pad_b[s, :b_t.shape[0], lo:hi] = b_t
        self.pad_a, self.pad_b = pad_a, pad_b


__all__ = ["ProjectionSlots"]
