"""What the LayerNorm / parallel-block families (StarCoder 2, Phi, StableLM, Cohere) refuse in
one line; their outputs are checked against transformers with every other family
(tests/engine/test_model_families.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qworker.model.families import spec_for
from qworker.model.lora.adapter import LoRAAdapterError, load_lora_adapter
from qworker.model.loader import load_config
from tests.engine.family_models import family_config
from tests.engine.lora_support import make_peft_adapter


@pytest.mark.parametrize("family", ["starcoder2", "phi"])
def test_a_lora_mlp_module_on_a_non_gated_family_is_refused_at_load(family, family_models, tmp_path):
    """Their MLPs are c_fc/c_proj or fc1/fc2: an up_proj tensor has nothing to adapt."""
    path = family_models.get(family)
    adapter = make_peft_adapter(path, tmp_path / "a", rank=4, target_modules=["q_proj"], seed=1)
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"] = torch.randn(4, 64)
    tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"] = torch.randn(96, 4)
    save_file(tensors, adapter / "adapter_model.safetensors")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj", "up_proj"]}))
    with pytest.raises(LoRAAdapterError, match=f"targets up_proj, which {family} models do not have"):
        load_lora_adapter(adapter, load_config(path), max_rank=8)


@pytest.mark.parametrize("family,overrides,message", [
    ("phi", dict(qk_layernorm=True), "qk_layernorm is not supported"),
    ("starcoder2", dict(hidden_act="relu6"), "unsupported hidden_act 'relu6'"),
    ("phi", dict(hidden_act="quick_gelu"), "unsupported hidden_act 'quick_gelu'"),
])
def test_configs_these_families_cannot_serve_are_refused_in_one_line(family, overrides, message):
    with pytest.raises(ValueError, match=message):
        spec_for(family_config(family, **overrides))
