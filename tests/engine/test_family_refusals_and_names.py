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
from qworker.model.families.spec import dims
from qworker.model.lora.adapter import LoRAAdapterError, load_lora_adapter
from qworker.model.loader import load_config
from qworker.model.rope import inverse_frequencies
from tests.engine.family_models import family_config
from tests.engine.lora_support import make_peft_adapter


@pytest.mark.parametrize("family,module,group,out", [
    ("starcoder2", "up_proj", "mlp", 96), ("phi", "up_proj", "mlp", 96), ("nemotron", "up_proj", "mlp", 96),  # non-gated MLPs
    ("glm", "gate_proj", "mlp", 96), ("glm4", "up_proj", "mlp", 96), ("phi3", "gate_proj", "mlp", 96),  # gate_up_proj fused
    ("phi", "o_proj", "self_attn", 64), ("phi3", "q_proj", "self_attn", 64),  # Phi's o is dense; Phi-3's q/k/v fused
])
def test_a_lora_module_the_family_does_not_have_is_refused_at_load(family, module, group, out, family_models, tmp_path):
    """PEFT finds no such module and drops its tensors (helper-89: qworker applied them to the fused
    projection, or to Phi's dense): refused by name instead."""
    path = family_models.get(family)
    adapter = make_peft_adapter(path, tmp_path / "a", rank=4, target_modules=["o_proj" if family == "phi3" else "q_proj"], seed=1)
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors[f"base_model.model.model.layers.0.{group}.{module}.lora_A.weight"] = torch.randn(4, 64)
    tensors[f"base_model.model.model.layers.0.{group}.{module}.lora_B.weight"] = torch.randn(out, 4)
    save_file(tensors, adapter / "adapter_model.safetensors")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": cfg["target_modules"] + [module]}))
    with pytest.raises(LoRAAdapterError, match=f"targets {module}, which {family} models do not have as a LoRA target"):
        load_lora_adapter(adapter, load_config(path), max_rank=8)


@pytest.mark.parametrize("family,overrides,message", [
    ("phi", dict(qk_layernorm=True), "qk_layernorm is not supported"),
    # helper-89: an odd rotary width (transformers fails on it) was served by rotating one channel more
    ("phi", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.35}), "gives 5 rotary channels"),
    ("stablelm", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.35}), "gives 5 rotary channels"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx is not supported"),
    ("opt", dict(do_layer_norm_before=False), "do_layer_norm_before=False"),
    ("opt", dict(word_embed_proj_dim=32), "word_embed_proj_dim differs from hidden_size"),
    ("gpt2", dict(activation_function="relu6"), "unsupported activation_function 'relu6'"),
    ("starcoder2", dict(hidden_act="relu6"), "unsupported hidden_act 'relu6'"),
    ("phi", dict(hidden_act="quick_gelu"), "unsupported hidden_act 'quick_gelu'"),
])
def test_configs_these_families_cannot_serve_are_refused_in_one_line(family, overrides, message):
    config = family_config(family, **overrides)
    with pytest.raises(ValueError, match=message):  # the family's spec, then its rope table, as the decoder builds them
        inverse_frequencies(config, dims(config).head_dim, partial=spec_for(config).partial_rotary)


def test_gpt2_as_its_own_exports_name_it_with_mask_buffers_serves_the_same_model(family_models, tmp_path):
    """GPT-2's hub exports name tensors without ``transformer.`` and carry causal-mask buffers
    (``attn.bias``, ``attn.masked_bias``): the same model, the buffers not read; a tensor the
    family does not read is still refused by name."""
    src = family_models.get("gpt2")
    tensors = {n.removeprefix("transformer."): t for n, t in load_file(src / "model.safetensors").items()}
    assert "h.0.attn.c_attn.weight" in tensors
    tensors.update({f"h.{i}.attn.bias": torch.ones(1, 1, 8, 8, dtype=torch.bool) for i in range(3)})
    tensors.update({f"h.{i}.attn.masked_bias": torch.tensor(-1e4) for i in range(3)})
    out = _rewritten(src, tensors, tmp_path / "bare")
    assert _greedy(out) == _greedy(src)
    save_file({**tensors, "h.0.attn.q_attn.weight": torch.ones(2, 2)}, out / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.0.attn.q_attn.weight"):
        LLM(str(out), dtype="float32", kv_cache_memory=8 << 20, block_size=16)


def test_gpt_neox_with_its_old_exports_mask_buffers_serves_the_same_model(family_models, tmp_path):
    """Older EleutherAI exports (Pythia, GPT-NeoX-20B) carry each layer's causal mask and rotary
    table (helper-90: refused as tensors the family does not use); transformers drops them."""
    src = family_models.get("gpt_neox")
    tensors = load_file(src / "model.safetensors")
    for i in range(3):
        p = f"gpt_neox.layers.{i}.attention."
        tensors.update({f"{p}bias": torch.ones(1, 1, 8, 8, dtype=torch.bool), f"{p}masked_bias": torch.tensor(-1e9),
                        f"{p}rotary_emb.inv_freq": torch.ones(4)})
    assert _greedy(_rewritten(src, tensors, tmp_path / "old")) == _greedy(src)


def _rewritten(src, tensors: dict, out):
    """A copy of the model folder ``src`` whose checkpoint holds ``tensors``."""
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((src / name).read_bytes())
    save_file(tensors, out / "model.safetensors")
    return out


def _greedy(path) -> list[int]:
    prompt = [[5, 900, 17, 4000, 23, 8, 301, 77, 12, 5000] * 3]
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=16)
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
