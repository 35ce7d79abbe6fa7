"""A model folder the loader cannot serve fails with one line naming what is wrong: the
unsupported ``model_type`` (with the supported list), or the missing / misshapen tensor."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from qworker.model.families import SUPPORTED
from qworker.model.loader import load_config
from qworker.model.runner import ModelRunner


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("model_type", ["bloom", "no_such_model_type"])
def test_unsupported_model_type_names_it_and_the_supported_ones(family_models, tmp_path, model_type):
    path = _copy(family_models.get("llama"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = model_type
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as exc:
        load_config(path)
    msg = str(exc.value)
    assert "\n" not in msg and repr(model_type) in msg
    assert all(t in msg for t in SUPPORTED)


@pytest.mark.parametrize("model_type, tensor", [
    ("llama", "model.layers.1.self_attn.k_proj.weight"),
    ("gemma3_text", "model.layers.2.post_feedforward_layernorm.weight"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.3.w2.weight"),
    ("phi3", "model.layers.0.self_attn.qkv_proj.weight"),
])
@pytest.mark.parametrize("fault", ["missing", "shape"])
def test_bad_tensor_is_one_line_naming_it(family_models, tmp_path, model_type, tensor, fault):
    path = _copy(family_models.get(model_type), tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    assert tensor in weights
    if fault == "missing":
        del weights[tensor]
    else:
        weights[tensor] = weights[tensor][:-1].contiguous()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as exc:
        ModelRunner(str(path), device="cpu", dtype="float32")
    msg = str(exc.value)
    assert "\n" not in msg and repr(tensor) in msg
    assert ("missing" in msg) == (fault == "missing")


def test_tensor_the_family_has_no_place_for_is_named(family_models, tmp_path):
    """A bias the config does not give (Llama without ``mlp_bias``) stops the load instead of being ignored."""
    import torch

    path = _copy(family_models.get("llama"), tmp_path / "m")
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.mlp.gate_proj.bias"] = torch.ones(96)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.0\.mlp\.gate_proj\.bias$"):
        ModelRunner(str(path), device="cpu", dtype="float32")
