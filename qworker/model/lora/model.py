"""LoRA on a loaded :class:`~qworker.model.decoder.DecoderModel`: wraps each layer's projections
once (:meth:`LoRAModel.__init__`), writes adapters into device slots (:meth:`LoRAModel.set`), and
tells the wrappers which rows run under which slot for one step (:meth:`LoRAModel.step`).

The wrappers replace ``layer.qkv``, ``layer.o``, ``layer.gate_up`` and ``layer.down`` (and the
dense MLP's own references to the last two) in place, so both forwards of the decoder pick them
up unchanged. MoE layers get attention slots only (the loader refuses MLP LoRA there). A model
without :class:`LoRAModel` runs its plain ``Linear`` objects, exactly as before.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from qworker.model.lora.adapter import LoRAAdapter
from qworker.model.lora.apply import LoRALinear, LoRAState, LoRAStep
from qworker.model.lora.stack import ProjectionSlots

# the decoder's fused projection -> the PEFT modules of its output slices, in column order
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoRAModel:
    def __init__(self, model, max_loras: int, max_rank: int):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        if not model.spec.lora_modules:  # every adapter would be refused: say so once, at start-up
            raise ValueError(f"enable_lora is not supported for {model.config.model_type} models: they have no LoRA target "
                             "(see README, LoRA targets)")
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layout = "stack" if getattr(model, "kernel_backend", None) == "triton" else "grouped"
        self.device = model.device
        self.state = LoRAState()
        self.slot_adapters: list[LoRAAdapter | None] = [None] * max_loras
        # self.slots[layer][projection] for the projections the layer has
        self.slots: list[dict[str, ProjectionSlots]] = []
        for layer in model.layers:
            per: dict[str, ProjectionSlots] = {}
            for proj in PROJECTIONS:
                base = getattr(layer, proj)
                if base is None:  # a MoE layer's MLP
                    continue
                if isinstance(base, LoRALinear):
                    raise RuntimeError("LoRA is already enabled on this model")
                slots = ProjectionSlots(base.in_features, self._out_slices(proj, base.out_features), max_loras, max_rank,
                                        model.device, model.act_dtype, self.layout)
                wrapper = LoRALinear(base, slots, self.state)
                setattr(layer, proj, wrapper)
                if proj in ("gate_up", "down") and getattr(layer.mlp, proj, None) is base:
                    setattr(layer.mlp, proj, wrapper)  # the general forward calls the MLP object
                per[proj] = slots
            self.slots.append(per)

    def _out_slices(self, proj: str, out_features: int) -> list[int]:
        m = self.model
        if proj == "qkv":
            return [m.q_size, m.kv_size, m.kv_size]
        if proj == "gate_up":
            return [out_features // 2, out_features // 2]
        return [out_features]

    def set(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Writes ``adapter`` into device slot ``slot`` (None clears it). Raises ValueError, leaving
        the slot as it was, for an adapter that does not fit (rank, layers, shapes)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} out of range 0..{self.max_loras - 1}")
        plan = self._plan(adapter) if adapter is not None else {}
        for layer_slots, layer_plan in zip(self.slots, self._per_layer(plan)):
            for proj, slots in layer_slots.items():
                slots.set(slot, [layer_plan.get(module) for module in PROJECTIONS[proj]])
        self.slot_adapters[slot] = adapter

    def _plan(self, adapter: LoRAAdapter) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.path!r} has rank {adapter.rank}, above max_lora_rank={self.max_rank}")
        for (layer, module), (a, b) in adapter.weights.items():
            proj = next((p for p, mods in PROJECTIONS.items() if module in mods), None)
            if proj is None or not 0 <= layer < len(self.slots) or proj not in self.slots[layer]:
                raise ValueError(f"LoRA adapter {adapter.path!r}: no {module} in layer {layer} of this model")
            slots = self.slots[layer][proj]
            out = slots.out_slices[PROJECTIONS[proj].index(module)]
            r = a.shape[0]
            if r > self.max_rank or a.shape != (r, slots.in_features) or b.shape != (out, r):
                raise ValueError(f"LoRA adapter {adapter.path!r}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                                 f"expected [r<={self.max_rank}, {slots.in_features}] and [{out}, r]")
        return adapter.weights

    def _per_layer(self, plan):
        per: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in self.slots]
        for (layer, module), pair in plan.items():
            per[layer][module] = pair
        return per

    @contextmanager
    def step(self, chunk_lengths: list[int], chunk_slots: list[int]):
        """The wrappers see this step's segments inside the ``with`` block (nothing if every
        chunk runs the base model)."""
        for s in chunk_slots:
            if s >= self.max_loras or s < -1:
                raise ValueError(f"LoRA slot {s} out of range -1..{self.max_loras - 1}")
        segments = LoRAStep.segments_of(chunk_lengths, chunk_slots)
        self.state.step = (LoRAStep(segments, sum(chunk_lengths), self.device, self.layout == "grouped", self.model.act_dtype, self.max_loras)
                           if segments else None)
        try:
            yield
        finally:
            self.state.step = None


__all__ = ["LoRAModel", "PROJECTIONS"]
