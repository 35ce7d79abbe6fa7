"""``LoRARequest``: which LoRA adapter a request runs under (vLLM's name and fields).

``lora_int_id`` is the adapter's identity inside the engine (slots, the CPU cache and the prefix
cache are keyed by it; it must be >= 1, 0 is the base model); ``lora_name`` is what users and
metrics call it; ``lora_path`` is a PEFT folder (``adapter_config.json`` +
``adapter_model.safetensors``). Two requests with the same ``lora_int_id`` must name the same
adapter."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_path, os.PathLike):  # a pathlib.Path: kept as the string it spells
            object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string or a path, got {type(self.lora_path).__name__}")
