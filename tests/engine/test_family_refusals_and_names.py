"""What the families added beside Llama's layout (StarCoder 2, Phi, StableLM, Cohere, GPT-2, ...)
refuse in one line, and the checkpoint names they read; their outputs are checked against
transformers with every other family (tests/engine/test_model_families.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qworker import LLM, SamplingParams
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
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx is not supported"),
    ("gpt2", dict(activation_function="relu6"), "unsupported activation_function 'relu6'"),
    ("starcoder2", dict(hidden_act="relu6"), "unsupported hidden_act 'relu6'"),
    ("phi", dict(hidden_act="quick_gelu"), "unsupported hidden_act 'quick_gelu'"),
])
def test_configs_these_families_cannot_serve_are_refused_in_one_line(family, overrides, message):
    with pytest.raises(ValueError, match=message):
        spec_for(family_config(family, **overrides))


def test_gpt2_as_its_own_exports_name_it_with_mask_buffers_serves_the_same_model(family_models, tmp_path):
    """GPT-2's hub exports name tensors without ``transformer.`` and carry causal-mask buffers
    (``attn.bias``, ``attn.masked_bias``): the same model, the buffers not read; a tensor the
    family does not read is still refused by name."""
    src = family_models.get("gpt2")
    tensors = {n.removeprefix("transformer."): t for n, t in load_file(src / "model.safetensors").items()}
    assert "h.0.attn.c_attn.weight" in tensors
    tensors.update({f"h.{i}.attn.bias": torch.ones(1, 1, 8, 8, dtype=torch.bool) for i in range(3)})
    tensors.update({f"h.{i}.attn.masked_bias": torch.tensor(-1e4) for i in range(3)})
    out = tmp_path / "bare"
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((src / name).read_bytes())
    save_file(tensors, out / "model.safetensors")
    prompt = [[5, 900, 17, 4000, 23, 8, 301, 77, 12, 5000] * 3]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(str(src), dtype="float32", kv_cache_memory=8 << 20, block_size=16).generate(prompt, greedy)[0].outputs[0].token_ids
    got = LLM(str(out), dtype="float32", kv_cache_memory=8 << 20, block_size=16).generate(prompt, greedy)[0].outputs[0].token_ids
    assert got == want
    save_file({**tensors, "h.0.attn.q_attn.weight": torch.ones(2, 2)}, out / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.attn.q_attn.weight"):
        LLM(str(out), dtype="float32", kv_cache_memory=8 << 20, block_size=16)
