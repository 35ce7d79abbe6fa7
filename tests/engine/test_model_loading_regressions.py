"""Regressions from helper-45's attack on bring-your-own-model loading (2026-12-06): checkpoints
that were served wrong or refused with an unclear error. Each failed before its fix.

- a NaN or infinite weight was served (every token came out as id 0);
- a tensor stored as integers (a quantized export without its config) was cast and served;
- a truncated safetensors file failed with an error that named no file;
- ``hidden_act: "swish"`` (transformers' other name for silu) was refused, as were Gemma's other
  names for GELU's tanh approximation;
- a folder without a tokenizer failed after all weights were loaded, with transformers' many-line
  error blaming missing packages;
- an explicit ``max_model_len`` past the model's positions was lowered without a word.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from qworker import LLM, SamplingParams
from qworker.model.families import spec_for
from qworker.model.runner import ModelRunner
from tests.engine.family_models import BASE, build_family_model
from tests.engine.family_reference import eager_greedy
from tests.engine.hf_reference import assert_greedy_matches

ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.fixture(scope="module")
def llama(tmp_path_factory, model_dir):
    return build_family_model("llama", tmp_path_factory.mktemp("llama") / "m", model_dir, seed=7, **ROPE)


def _copy_with(src, dst, edit):
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_weight_is_refused_by_name(llama, tmp_path, value):
    name = "model.layers.1.mlp.down_proj.weight"
    path = _copy_with(llama, tmp_path / "bad", lambda w: w[name].view(-1).__setitem__(7, value))
    with pytest.raises(ValueError, match=f"tensor '{name}' holds NaN or infinite values"):
        ModelRunner(str(path), dtype="float32")


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.bool, torch.float8_e4m3fn])
def test_a_tensor_not_stored_as_float_weights_is_refused_by_name(llama, tmp_path, dtype):
    name = "model.layers.0.mlp.up_proj.weight"
    path = _copy_with(llama, tmp_path / "int", lambda w: w.__setitem__(name, w[name].clamp(-100, 100).to(dtype)))
    with pytest.raises(ValueError, match=f"tensor '{name}' is stored as {dtype}, not as floating-point weights"):
        ModelRunner(str(path), dtype="float32")


def test_a_truncated_checkpoint_names_its_file(llama, tmp_path):
    path = tmp_path / "cut"
    shutil.copytree(llama, path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a readable safetensors file"):
        ModelRunner(str(path), dtype="float32")


def test_swish_is_silu(llama, tmp_path):
    path = tmp_path / "swish"
    shutil.copytree(llama, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_act"] = "swish"
    (path / "config.json").write_text(json.dumps(cfg))
    prompt = list(range(300, 320))
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert_greedy_matches(list(out.outputs[0].token_ids), eager_greedy(llama, prompt, 6), "swish")


@pytest.mark.parametrize("name", ["gelu_new", "gelu_fast"])
def test_gemma_takes_every_name_of_the_tanh_gelu(name):
    config = AutoConfig.for_model("gemma2", **{**BASE, "hidden_activation": name})
    assert spec_for(config).activation == "gelu_tanh"


def test_a_folder_without_a_tokenizer_is_one_line_before_any_weight(llama, tmp_path, monkeypatch):
    path = tmp_path / "notok"
    shutil.copytree(llama, path)
    for f in path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            f.unlink()
    import qworker.model.runner as runner

    def no_weights(*a, **k):
        raise AssertionError("the weights were loaded before the tokenizer was checked")

    monkeypatch.setattr(runner, "load_state_dict", no_weights)
    with pytest.raises(ValueError, match=f"{path}: no tokenizer that transformers can load") as info:
        LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    assert "\n" not in str(info.value)


def test_max_model_len_past_the_models_positions_is_said(llama, caplog):
    with caplog.at_level(logging.WARNING, logger="qworker.model.runner"):
        runner = ModelRunner(str(llama), dtype="float32", max_model_len=100_000)
    positions = AutoConfig.from_pretrained(llama).max_position_embeddings
    assert runner.max_model_len == positions
    assert any(f"max_model_len=100000 is past what {llama} serves exactly ({positions} positions)" in r.getMessage()
               for r in caplog.records)


# helper-56 (2026-12-06, later): configs served, and computed otherwise than transformers does
def _greedy_matches_hf(path, what: str) -> None:
    prompt = list(range(300, 340))
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert_greedy_matches(list(out.outputs[0].token_ids), eager_greedy(path, prompt, 6), what)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_partial_rotary_factor_is_ignored_where_transformers_ignores_it(model_type, model_dir, tmp_path):
    """Only Phi-3 rotates part of each head in transformers; other families rotate whole heads
    whatever ``partial_rotary_factor`` says. qworker rotated half the head of a Llama given 0.5."""
    path = build_family_model(model_type, tmp_path / "m", model_dir, seed=3, partial_rotary_factor=0.5, **ROPE)
    _greedy_matches_hf(path, f"{model_type} with partial_rotary_factor 0.5")


def test_a_tied_config_with_a_different_stored_head_serves_the_stored_head(llama, tmp_path, caplog):
    """transformers unties them then (with a warning) and serves the stored head; qworker threw it
    away and served the embedding (every greedy token differed)."""
    path = tmp_path / "tied"
    shutil.copytree(llama, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(path / "model.safetensors"))
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    with caplog.at_level(logging.WARNING):
        _greedy_matches_hf(path, "tied config, distinct stored head")
    assert "serving the stored head" in caplog.text


def test_a_bidirectional_gemma3_is_refused(model_dir, tmp_path):
    """EmbeddingGemma's config (``use_bidirectional_attention``): transformers attends both ways,
    qworker served it with a causal mask. It is an embedding model: refused by name."""
    config = AutoConfig.for_model("gemma3_text", **{**BASE, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        spec_for(config)
