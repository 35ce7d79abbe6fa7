"""The runner's forward equals HF transformers for each supported family (tiny random weights):
Llama with llama3 rope scaling, Mistral, and Qwen2 with its q/k/v biases."""

from __future__ import annotations

import random

import pytest
import torch

from qworker import LLM, SamplingParams
from tests.engine.hf_reference import assert_greedy_matches, hf_greedy

COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


def build(kind: str, out):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(random.randrange(1 << 30))
    if kind == "llama3_rope":
        cfg = LlamaConfig(**COMMON, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(cfg)
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**COMMON, tie_word_embeddings=False, sliding_window=None))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=True))
        with torch.no_grad():  # random init leaves biases at zero: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.eval().save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("kind", ["llama3_rope", "mistral", "qwen2_bias"])
def test_family_greedy_matches_hf(tmp_path, model_dir, kind):
    import shutil

    path = build(kind, tmp_path / kind)
    shutil.copy(model_dir / "tokenizer.json", path)
    shutil.copy(model_dir / "tokenizer_config.json", path)
    rng = random.Random()
    prompts = [[rng.randrange(3, 49000) for _ in range(rng.randrange(2, 90))] for _ in range(3)]
    llm = LLM(str(path), kv_cache_memory=4 << 20, block_size=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert_greedy_matches(o.outputs[0].token_ids, hf_greedy(str(path), p, 12), kind)
