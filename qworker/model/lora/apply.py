"""One step's LoRA: which rows run under which slot, and the projection wrapper that adds
``x @ A.T @ B.T`` (scaling in B) to the base projection's output for those rows.

:class:`LoRAStep` is built once per step from the batch's chunks (rows of one chunk are
contiguous; consecutive chunks of one slot merge into one segment; slot ``-1`` rows are left
alone). Every :class:`LoRALinear` of the model reads the same :class:`LoRAState`, which holds the
step while the forward runs and ``None`` otherwise (then the wrapper costs one attribute test).

Two paths, by the slots' layout (:mod:`.stack`):

* grouped (CPU): per slot, its rows (a slice when its segments are one run, else an index
  gather) go through the slot's shrink and expand GEMMs once, and the result is added into the
  columns the adapter targets. When slots' rows are scattered and about as many (decode), all
  slots run at once instead: their rows gathered into a ``[slots, M, in]`` block (short groups
  padded, the padding's products zeroed), two batched GEMMs over the padded stacks, and every
  row of ``y`` adds its row of the result (base rows a zero padding row): six ops per projection
  whatever the number of slots. (A gather, not ``index_add_``: torch's CPU ``index_add_`` adds
  one row at a time and was as slow as the two GEMMs together.)
* stack (Triton backend): ``kernels.lora_sgmv.lora_shrink`` once over all segments, then
  ``lora_expand`` per output slice, in place. Where that module is unavailable (no triton, or
  not built yet) the same stacks run through a torch loop over the segments.
"""

from __future__ import annotations

import torch

from qworker.model.lora.stack import ProjectionSlots


class LoRAStep:
    """The adapter segments of one step over its ``T`` rows."""

    __slots__ = ("slots", "segments", "num_tokens", "groups", "padded", "seg_start", "seg_len", "seg_slot", "tiles")

    def __init__(self, segments: list[tuple[int, int, int]], num_tokens: int, device: torch.device, grouped: bool,
                 dtype: torch.dtype = torch.float32, max_loras: int | None = None):
        """``segments``: ``(start, length, slot)`` with ``slot >= 0``, disjoint, in row order,
        inside the step's ``num_tokens`` rows; ``dtype``: the activations'."""
        self.segments = segments
        self.num_tokens = num_tokens
        self.tiles = None  # the kernels' tile map, built by the first projection that needs it
        self.slots = frozenset(s for _, _, s in segments)
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        # (slot ids or None for all slots in order, row index [S*M], pad mask [S, M, 1], S, M,
        #  each of the T rows' position in the padded result [T])
        self.padded = None
        self.seg_start = self.seg_len = self.seg_slot = None
        if grouped:
            runs: dict[int, list[tuple[int, int]]] = {}
            for start, length, slot in segments:
                runs.setdefault(slot, []).append((start, length))
            counts = {slot: sum(n for _, n in rs) for slot, rs in runs.items()}
            M = max(counts.values())
            # batched when some slot needs a gather anyway and padding at most doubles the rows
            if any(len(rs) > 1 for rs in runs.values()) and len(runs) * M <= 2 * sum(counts.values()):
                if sum(counts.values()) < num_tokens:
                    M += 1  # base rows read a zero row: make sure one exists
                self.padded = self._padded(runs, M, num_tokens, device, dtype, max_loras)
                return
            for slot, rs in runs.items():
                if len(rs) == 1:
                    rows = slice(rs[0][0], rs[0][0] + rs[0][1])
                else:
                    rows = torch.cat([torch.arange(s, s + n) for s, n in rs]).to(device)
                self.groups.append((slot, rows))
        else:
            cols = list(zip(*segments))
            self.seg_start, self.seg_len, self.seg_slot = (torch.tensor(c, dtype=torch.int32, device=device) for c in cols)

    @staticmethod
    def _padded(runs: dict[int, list[tuple[int, int]]], M: int, T: int, device, dtype, max_loras):
        ids = sorted(runs)
        index = torch.zeros(len(ids), M, dtype=torch.long)
        mask = torch.zeros(len(ids), M, 1, dtype=dtype)
        where = None
        for i, slot in enumerate(ids):
            rows = torch.cat([torch.arange(s, s + n) for s, n in runs[slot]])
            n = len(rows)
            index[i, :n] = rows
            mask[i, :n] = 1
            if n < M and where is None:
                where = torch.full((T,), i * M + n, dtype=torch.long)  # a padding row: zero
        if where is None:
            where = torch.zeros(T, dtype=torch.long)  # every row runs under an adapter
        for i, slot in enumerate(ids):
            n = int(mask[i].sum())
            where[index[i, :n]] = torch.arange(i * M, i * M + n)
        every = max_loras is not None and ids == list(range(max_loras))
        slot_ids = None if every else torch.tensor(ids, dtype=torch.long, device=device)
        return slot_ids, index.flatten().to(device), mask.to(device), len(ids), M, where.to(device)

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
    """``y[rows, lo:hi] += (x[rows] @ a_t) @ b_t`` per slot of the step, in place."""
    if step.padded is not None:
        slot_ids, index, mask, S, M, where = step.padded
        a, b = slots.pad_a, slots.pad_b
        if slot_ids is not None:
            a, b = a.index_select(0, slot_ids), b.index_select(0, slot_ids)
        h = torch.bmm(x.index_select(0, index).view(S, M, -1), a)
        h.mul_(mask)  # padding rows gathered row 0: their products must be zero
        y.add_(torch.bmm(h, b).view(S * M, -1).index_select(0, where))
        return
    for slot, rows in step.groups:
        g = slots.grouped[slot]
        if g is None:
            continue
        a_t, b_t, lo, hi = g
        if isinstance(rows, slice):
            y[rows, lo:hi].addmm_(x[rows] @ a_t, b_t)
        else:
            y[:, lo:hi].index_add_(0, rows, (x.index_select(0, rows) @ a_t) @ b_t)


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
    if not k:
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


__all__ = ["LoRALinear", "LoRAState", "LoRAStep", "apply_grouped", "apply_stack", "apply_stack_torch"]
