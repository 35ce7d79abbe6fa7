"""One step's LoRA: which rows run under which slot, and the projection wrapper that adds
``x @ A.T @ B.T`` (scaling in B) to the base projection's output for those rows.

:class:`LoRAStep` is built once per step from the batch's chunks (rows of one chunk are
contiguous; consecutive chunks of one slot merge into one segment; slot ``-1`` rows are left
alone). Every :class:`LoRALinear` of the model reads the same :class:`LoRAState`, which holds the
step while the forward runs and ``None`` otherwise (then the wrapper costs one attribute test).

Two paths, by the slots' layout (:mod:`.stack`):

* grouped (CPU), on the C GEMM where it runs (:func:`apply_packed`, the default): per adapter,
  a shrink and one block-diagonal expand, each output one fixed-order sum, so a row's delta does
  not depend on the step (batch-invariant); long segments in place, short rows gathered per slot
  and added back with one ``index_add_``. Without the C kernels, torch's GEMMs as follows (not
  batch-invariant: they pick kernels by shape):
  a segment of at least :data:`LONG_SEGMENT` rows (prefill) runs alone: its
  slot's shrink GEMM on the row slice, then one ``addmm_`` per targeted slice straight into
  ``y``'s rows and columns. The shorter segments (decode) run together, every slot at once:
  their rows gathered into a ``[slots, M, in]`` block (short groups padded, the padding's
  products zeroed), a batched shrink over ``pad_a``, a batched expand per slice; then either
  every row of ``y`` adds its row of the result (when the short rows are most of the step; base
  rows read a zero padding row) or only the short rows are read, added and written back. Never
  ``index_add_`` into column slices: torch's CPU kernel adds one row at a time there and was
  5x slower than a gather and an add.
* stack (Triton backend): ``kernels.lora_sgmv.lora_shrink`` once over all segments, then
  ``lora_expand`` per output slice, in place. Where that module is unavailable (no triton) or
  ``max_lora_rank`` exceeds what the expand kernel holds (128), the same stacks run through a
  torch loop over the segments.
"""

from __future__ import annotations

import torch

from qworker.model.lora.stack import ProjectionSlots

# segments this long run alone (row slices, no gather); shorter ones run batched over all slots
LONG_SEGMENT = 16
# lora_expand holds a rank in one tile; larger max_lora_rank runs the stacks through torch
KERNEL_MAX_RANK = 128


class LoRAStep:
    """The adapter segments of one step over its ``T`` rows."""

    __slots__ = ("slots", "segments", "num_tokens", "long", "padded", "seg_start", "seg_len", "seg_slot", "tiles", "rows",
                 "by_slot")

    def __init__(self, segments: list[tuple[int, int, int]], num_tokens: int, device: torch.device, grouped: bool,
                 dtype: torch.dtype = torch.float32, max_loras: int | None = None):
        """``segments``: ``(start, length, slot)`` with ``slot >= 0``, disjoint, in row order,
        inside the step's ``num_tokens`` rows; ``dtype``: the activations'."""
        self.segments = segments
        self.num_tokens = num_tokens
        self.tiles = None  # the kernels' tile map, built by the first projection that needs it
        self.slots = frozenset(s for _, _, s in segments)
        self.long: list[tuple[slice, int]] = []  # (rows, slot) of the segments that run alone
        self.padded: Padded | None = None  # the short segments, batched
        self.seg_start = self.seg_len = self.seg_slot = None
        # the C GEMM path's short rows: their indices ordered by slot, and each slot's run of them
        self.rows: torch.Tensor | None = None
        self.by_slot: list[tuple[int, int, int]] = []
        if grouped:
            short: dict[int, list[tuple[int, int]]] = {}
            for start, length, slot in segments:
                if length >= LONG_SEGMENT:
                    self.long.append((slice(start, start + length), slot))
                else:
                    short.setdefault(slot, []).append((start, length))
            if short:
                self.padded = Padded(short, num_tokens, device, dtype, max_loras)
                at = 0
                for slot, runs in short.items():
                    n = sum(length for _, length in runs)
                    self.by_slot.append((slot, at, at + n))
                    at += n
                self.rows = torch.cat([torch.arange(s, s + n) for runs in short.values() for s, n in runs]).to(device)
        else:
            cols = list(zip(*segments))
            self.seg_start, self.seg_len, self.seg_slot = (torch.tensor(c, dtype=torch.int32, device=device) for c in cols)

    @staticmethod
    def segments_of(chunk_lengths: list[int], chunk_slots: list[int]) -> list[tuple[int, int, int]]:
        """Merged ``(start, length, slot)`` runs of the chunks with a slot >= 0."""
        segments: list[tuple[int, int, int]] = []
        at = 0
        for n, slot in zip(chunk_lengths, chunk_slots):
            if slot >= 0 and n > 0:
                if segments and segments[-1][2] == slot and segments[-1][0] + segments[-1][1] == at:
                    start, length, _ = segments[-1]
                    segments[-1] = (start, length + n, slot)
                else:
                    segments.append((at, n, slot))
            at += n
        return segments


class Padded:
    """The short segments of a step as a ``[S, M]`` grid: row ``i`` holds slot ``slot_ids[i]``'s
    rows (``index``), padded to ``M`` with row 0 (``pad`` marks them; their products are set to
    zero, not multiplied by it: row 0 may hold Inf or NaN, and base rows read a padding
    position, so a product of 0 and Inf would reach rows of other requests). The result
    goes back either through ``where`` (every one of the ``T`` rows' position in the grid; rows
    not in it read a zero padding position) or, when the short rows are few, through ``rows``
    and their positions ``pos``."""

    __slots__ = ("slot_ids", "index", "pad", "S", "M", "where", "rows", "pos")

    def __init__(self, short: dict[int, list[tuple[int, int]]], T: int, device, dtype, max_loras: int | None):
        ids = sorted(short)
        counts = [sum(n for _, n in short[s]) for s in ids]
        n_short = sum(counts)
        M = max(counts)
        full = 2 * n_short >= T  # mostly short rows: a full-width gather beats indexing y
        if full and n_short < T and min(counts) == M:
            M += 1  # the other rows read a zero padding position: make sure one exists
        index = torch.zeros(len(ids), M, dtype=torch.long)
        pad = torch.ones(len(ids), M, 1, dtype=torch.bool)
        for i, slot in enumerate(ids):
            index[i, :counts[i]] = torch.cat([torch.arange(s, s + n) for s, n in short[slot]])
            pad[i, :counts[i]] = False
        positions = torch.cat([torch.arange(i * M, i * M + n) for i, n in enumerate(counts)])
        rows = torch.cat([index[i, :n] for i, n in enumerate(counts)])
        self.where = self.rows = self.pos = None
        if full:
            zero = next((i * M + n for i, n in enumerate(counts) if n < M), 0)
            where = torch.full((T,), zero, dtype=torch.long)
            where[rows] = positions
            self.where = where.to(device)
        else:
            self.rows, self.pos = rows.to(device), positions.to(device)
        every = max_loras is not None and ids == list(range(max_loras))
        self.slot_ids = None if every else torch.tensor(ids, dtype=torch.long, device=device)
        self.index = index.flatten().to(device)
        self.pad = pad.to(device)
        self.S, self.M = len(ids), M


class LoRAState:
    """The step every wrapper reads (``None`` between steps and in steps without adapter rows)."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRALinear:
    """A base projection plus its LoRA slots; called like the base ``Linear``. Attributes it does
    not have (``in_features``, ``weight``, ...) are the base's."""

    __slots__ = ("base", "slots", "state")

    def __init__(self, base, slots: ProjectionSlots, state: LoRAState):
        self.base = base
        self.slots = slots
        self.state = state

    def __getattr__(self, name):
        if name in LoRALinear.__slots__:  # not set yet (copy, unpickling): no recursion into base
            raise AttributeError(name)
        return getattr(self.base, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.state.step
        if step is not None:
            slots = self.slots
            if any(slots.active[s] for s in step.slots):
                if slots.layout == "grouped":
                    apply_grouped(slots, x, y, step)
                else:
                    apply_stack(slots, x, y, step)
        return y


def apply_grouped(slots: ProjectionSlots, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> None:
    """Adds every adapter row's ``(x @ A.T) @ B.T`` into ``y`` in place (see the module docstring)."""
    if slots.packed is not None:
        apply_packed(slots, x, y, step)
        return
    for rows, slot in step.long:
        g = slots.grouped[slot]
        if g is None:
            continue
        a_t, parts = g
        h = x[rows] @ a_t
        for b_t, k0, k1, o0, o1 in parts:
            y[rows, o0:o1].addmm_(h[:, k0:k1], b_t)
    p = step.padded
    if p is None or slots.pad_a is None:
        return
    S, M = p.S, p.M
    a = slots.pad_a if p.slot_ids is None else slots.pad_a.index_select(0, p.slot_ids)
    h = torch.bmm(x.index_select(0, p.index).view(S, M, -1), a)
    h.masked_fill_(p.pad, 0)  # padding gathered row 0: its products must be zero (even from Inf/NaN)
    for pb, k0, k1, o0, o1 in slots.pad_b:
        b = pb if p.slot_ids is None else pb.index_select(0, p.slot_ids)
        d = torch.bmm(h[:, :, k0:k1], b).view(S * M, o1 - o0)
        if p.where is not None:
            y[:, o0:o1].add_(d.index_select(0, p.where))
        else:
            y[p.rows, o0:o1] += d.index_select(0, p.pos)


def apply_packed(slots: ProjectionSlots, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> None:
    """The grouped layout on the C GEMM (``slots.packed``, see :mod:`.stack`): a long segment's
    rows in place, the short rows gathered per slot; each adapter's shrink and block-diagonal
    expand make every output one sum in a fixed order, so a row's delta is the same whatever else
    the step holds."""
    gemm = slots.gemm
    for rows, slot in step.long:
        p = slots.packed[slot]
        if p is not None:
            a, k, b, c0, c1 = p
            h = torch.empty(rows.stop - rows.start, k)
            gemm(x[rows], h, a, k)
            d = torch.empty(h.shape[0], c1 - c0)
            gemm(h, d, b, c1 - c0)
            y[rows, c0:c1] += d
    if step.rows is None or not any(slots.packed[slot] is not None for slot, _, _ in step.by_slot):
        return
    xs = x.index_select(0, step.rows)
    # whole rows go back with one index_add_ (indexing a column slice of y was 8x slower); columns
    # a slot's adapter leaves alone, and an untargeted slot's rows, add zeros
    d = torch.zeros(xs.shape[0], y.shape[1])
    for slot, r0, r1 in step.by_slot:
        p = slots.packed[slot]
        if p is not None:
            a, k, b, c0, c1 = p
            h = torch.empty(r1 - r0, k)
            gemm(xs[r0:r1], h, a, k)
            gemm(h, d[r0:r1, c0:c1], b, c1 - c0)
    y.index_add_(0, step.rows, d)


_kernels = None


def _sgmv():
    """``kernels.lora_sgmv`` if it imports, else False (remembered)."""
    global _kernels
    if _kernels is None:
        try:
            from kernels import lora_sgmv
            _kernels = lora_sgmv
        except ImportError:
            _kernels = False
    return _kernels


def apply_stack(slots: ProjectionSlots, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> None:
    """Shrink over every segment, then expand each output slice into its columns of ``y``."""
    k = _sgmv()
    if not k or slots.max_rank > KERNEL_MAX_RANK:
        apply_stack_torch(slots, x, y, step)
        return
    R = slots.max_rank
    if step.tiles is None:  # one tile map serves every shrink and expand of the step
        from kernels.lora_reference import lora_tiles

        T = step.num_tokens
        step.tiles = lora_tiles(step.seg_start, step.seg_len, step.seg_slot, T, k.default_block_m(T, len(step.segments)))
    tiles = step.tiles
    h = k.lora_shrink(x, slots.a_stack, step.seg_start, step.seg_len, step.seg_slot, tiles=tiles)
    for i, (b_stack, offset) in enumerate(zip(slots.b_stacks, slots.offsets)):
        k.lora_expand(h[:, i * R:(i + 1) * R], b_stack, step.seg_start, step.seg_len, step.seg_slot, y, offset, tiles=tiles)


def apply_stack_torch(slots: ProjectionSlots, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> None:
    """The stack layout in torch: per segment and slice, ``y[s:e, cols] += (x[s:e] @ A.T) @ B.T``."""
    R = slots.max_rank
    for start, length, slot in step.segments:
        if not slots.active[slot]:
            continue
        rows = slice(start, start + length)
        h = x[rows].float() @ slots.a_stack[slot].float().T
        for i, (b_stack, offset, out) in enumerate(zip(slots.b_stacks, slots.offsets, slots.out_slices)):
            delta = h[:, i * R:(i + 1) * R] @ b_stack[slot].float().T
            y[rows, offset:offset + out] += delta.to(y.dtype)


__all__ = ["LoRALinear", "LoRAState", "LoRAStep", "apply_grouped", "apply_packed", "apply_stack", "apply_stack_torch"]
