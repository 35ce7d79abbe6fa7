"""The device LoRA slots of one projection of one layer.

A projection has ``n`` output slices (fused q/k/v: 3, fused gate/up: 2, o and down: 1), each
the output of one PEFT module. Each of the ``max_loras`` slots holds one adapter's matrices for
them, the scaling already in B. Two layouts, chosen by the model's kernel backend:

* ``"stack"`` (the Triton kernels of :mod:`kernels.lora_sgmv`): ``a_stack [S, n*R, in]`` with
  slice ``i``'s A in rows ``i*R : i*R + r`` and ``b_stacks[i] [S, out_i, R]`` with its B in
  columns ``:r``; ranks below ``R = max_rank`` and modules an adapter does not target are zeros.
* ``"grouped"`` (CPU): row-major GEMM operands, the ``x @ w`` layout of
  :class:`~qworker.model.linear.Linear`'s ``"matmul"`` path (not oneDNN's packed weights: with
  LoRA's ``k`` in the tens its primitives were 5-10x slower than MKL's ``x @ w`` on the development
  VM, 16 rows expanded to 960 columns in 730 us against 120 us). Per slot, ``grouped[s] =
  (a_t, parts)``: ``a_t [in, k]`` the targeted slices' A rows concatenated (``k`` the sum of their
  ranks, no padding) and per targeted slice ``(b_t [r_i, out_i], k0, k1, o0, o1)``: its B, the
  columns ``k0:k1`` of ``x @ a_t`` it reads and the output columns ``o0:o1`` it adds to (one
  GEMM per slice: a block-diagonal B would multiply the zeros too, 2-3x the expand's work).
  The same matrices also sit in ``pad_a [S, in, K]`` and per slice ``pad_b`` parts
  ``([S, K_i, out_i], k0, k1, o0, o1)``, ranks zero-padded to the largest of the slots (``K_i``;
  ``K`` their sum; they grow with the largest rank seen and never shrink): a step whose slots'
  rows are short and scattered (decode) runs every slot at once as batched GEMMs instead of
  GEMMs per segment.

  Where the C kernels run (fp32 activations on the CPU), each slot's matrices are also packed
  for :func:`kernels.gemm_cpu.gemm` (``packed[s] = (A, k, B, c0, c1)``: A the targeted slices'
  rows ``[k, in]``, B ``[c1 - c0, k]`` their B's block-diagonal over the output columns
  ``c0:c1`` the targeted slices span: one expand per adapter, its zeros' products exactly zero,
  fewer calls than one per slice, which cost more than the zeros' arithmetic). Its sums run in
  one fixed order per output, whatever the number of rows,
  so an adapter row's result depends on nothing else in the step (batch-invariant, as the base
  projections are); torch's GEMMs pick kernels by shape, and a row's delta then changed with its
  segment's length (a speculative verify chunk against a plain decode row).

``active[s]`` says whether slot ``s`` changes this projection at all: projections that no slot
of a step targets are skipped.
"""

from __future__ import annotations

import torch


def _row_invariant_gemm(device: torch.device, dtype: torch.dtype):
    """The C fp32 GEMM (:func:`kernels.gemm_cpu.f32_gemm_fn`) where it runs these activations, else None."""
    from kernels import gemm_cpu

    return gemm_cpu.f32_gemm_fn() if device.type == "cpu" and dtype == torch.float32 else None


class ProjectionSlots:
    __slots__ = ("in_features", "out_slices", "offsets", "max_rank", "layout", "active", "a_stack", "b_stacks", "grouped",
                 "pad_a", "pad_b", "ranks", "dtype", "device", "max_loras", "packed", "gemm")

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
        self.pad_b: list[tuple[torch.Tensor, int, int, int, int]] = []
        # per slot, per slice: the rank (0 where the slot's adapter leaves the slice alone)
        self.ranks = [[0] * len(out_slices) for _ in range(max_loras)]
        self.device = device
        self.active = [False] * max_loras
        self.a_stack: torch.Tensor | None = None
        self.b_stacks: list[torch.Tensor] = []
        self.grouped: list[tuple[torch.Tensor, list[tuple[torch.Tensor, int, int, int, int]]] | None] = [None] * max_loras
        self.gemm = _row_invariant_gemm(torch.device(device), dtype) if layout == "grouped" else None
        self.packed: list[tuple[torch.Tensor, int, torch.Tensor, int, int] | None] | None = (
            [None] * max_loras if self.gemm is not None else None)
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
        self.ranks[slot] = [0 if p is None else p[0].shape[0] for p in pairs]
        targeted = [i for i, p in enumerate(pairs) if p is not None]
        if not targeted:
            self.grouped[slot] = None
        else:
            a_t = torch.cat([pairs[i][0] for i in targeted]).to(self.device, self.dtype).t().contiguous()
            parts, k0 = [], 0
            for i in targeted:
                b = pairs[i][1]
                r = b.shape[1]
                parts.append((b.to(self.device, self.dtype).t().contiguous(), k0, k0 + r, self.offsets[i], self.offsets[i] + self.out_slices[i]))
                k0 += r
            self.grouped[slot] = (a_t, parts)
        if self.packed is not None:
            self.packed[slot] = None if not targeted else self._pack(a_t, parts)
        self._repad(slot)

    @staticmethod
    def _pack(a_t: torch.Tensor, parts) -> tuple[torch.Tensor, int, torch.Tensor, int, int]:
        from kernels.gemm_cpu import pack_weight

        c0, c1 = min(p[3] for p in parts), max(p[4] for p in parts)
        k = a_t.shape[1]
        b = torch.zeros(c1 - c0, k, dtype=a_t.dtype)
        for b_t, k0, k1, o0, o1 in parts:
            b[o0 - c0:o1 - c0, k0:k1] = b_t.t()
        return pack_weight(a_t.t()), k, pack_weight(b), c0, c1

    def _repad(self, slot: int) -> None:
        """Writes ``slot`` into ``pad_a`` / ``pad_b``. The padded widths only grow (a slot's new
        rank above them rebuilds both from every slot; anything else rewrites this slot alone),
        so swapping adapters of one rank costs one slot's copy."""
        widths = [max(w, self.ranks[slot][i]) for i, w in enumerate(self._widths())]
        if widths != self._widths():
            self._rebuild(widths)
            return
        if self.pad_a is None:
            return
        self.pad_a[slot].zero_()
        for pb, _, _, _, _ in self.pad_b:
            pb[slot].zero_()
        self._write_padded(slot)

    def _widths(self) -> list[int]:
        if self.pad_a is None:
            return [0] * len(self.out_slices)
        widths = [0] * len(self.out_slices)
        for pb, k0, k1, o0, _ in self.pad_b:
            widths[self.offsets.index(o0)] = k1 - k0
        return widths

    def _rebuild(self, widths: list[int]) -> None:
        starts = [sum(widths[:i]) for i in range(len(widths))]
        self.pad_a = torch.zeros(self.max_loras, self.in_features, sum(widths), device=self.device, dtype=self.dtype)
        self.pad_b = [(torch.zeros(self.max_loras, w, self.out_slices[i], device=self.device, dtype=self.dtype), starts[i], starts[i] + w,
                       self.offsets[i], self.offsets[i] + self.out_slices[i]) for i, w in enumerate(widths) if w]
        for s in range(self.max_loras):
            self._write_padded(s)

    def _write_padded(self, slot: int) -> None:
        g = self.grouped[slot]
        if g is None:
            return
        a_t, parts = g
        pads = {o0: (pb, k0) for pb, k0, _, o0, _ in self.pad_b}
        for b_t, k0, k1, o0, _ in parts:
            pb, start = pads[o0]
            self.pad_a[slot, :, start:start + k1 - k0] = a_t[:, k0:k1]
            pb[slot, :k1 - k0] = b_t


__all__ = ["ProjectionSlots"]
