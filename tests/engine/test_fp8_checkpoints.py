"""FP8 checkpoints (:mod:`qworker.model.fp8`), dequantized at load. Fine-grained FP8 (DeepSeek-V3/R1's
and Qwen3-FP8's format: float8_e4m3fn weights with an fp32 scale per block): greedy tokens equal
transformers' own dequantized model (``FineGrainedFP8Config(dequantize=True)``); with partial
blocks (which transformers' loader refuses and DeepSeek's 576-row projection has), the same logits
as a plain checkpoint holding the weights dequantized here by hand. compressed-tensors'
float-quantized FP8 (per tensor, channel or block; the package is not installed here, so the
reference is the hand-dequantized checkpoint). Malformed ones refused in one line."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from qworker import LLM, SamplingParams
from qworker.model.batch import Batch, SeqChunk
from qworker.model.runner import ModelRunner
from tests.engine.family_models import build_family_model
from tests.engine.hf_reference import assert_greedy_matches

PROMPTS = [list(range(300, 305)), list(range(1000, 1060))]


def _quantized(weight: torch.Tensor, block: tuple[int, int] | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[..., out, in]`` as e4m3 with an fp32 scale per block (amax / 448, partial blocks
    at the ends), per "channel" (``[..., out, 1]``) or per "tensor" (``[1]``)."""
    if block in ("channel", "tensor"):
        amax = weight.abs().amax(dim=-1, keepdim=True) if block == "channel" else weight.abs().amax().reshape(1)
        scale = (amax / 448.0).clamp(min=1e-12)
        return (weight / scale).to(torch.float8_e4m3fn), scale
    rows, cols = weight.shape[-2:]
    block = (min(block[0], rows), min(block[1], cols))  # a block past the weight's edge covers it all
    nb = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    padded = torch.zeros(*weight.shape[:-2], nb[0] * block[0], nb[1] * block[1])
    padded[..., :rows, :cols] = weight
    amax = padded.unflatten(-1, (nb[1], block[1])).unflatten(-3, (nb[0], block[0])).abs().amax(dim=(-3, -1))
    scale = (amax / 448.0).clamp(min=1e-12)
    expanded = scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :cols]
    return (weight / expanded).to(torch.float8_e4m3fn), scale


def _by_hand(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | str) -> torch.Tensor:
    if block in ("channel", "tensor"):
        return q.float() * scale
    rows, cols = q.shape[-2:]
    block = (min(block[0], rows), min(block[1], cols))
    return q.float() * scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :rows, :cols]


def _is_projection(name: str, t: torch.Tensor) -> bool:
    return t.dim() >= 2 and name.endswith("weight") and not any(s in name for s in ("embed", "lm_head", "norm", "mlp.gate.weight"))


def fp8_copy(src: Path, dst: Path, block: tuple[int, int] | str, plain: Path | None = None, compressed_tensors: bool = False) -> Path:
    """``src`` with every projection in FP8 (``dst``): fine-grained FP8, or compressed-tensors'
    (``block`` a pair, "channel" or "tensor"); ``plain``: the same model with those weights
    dequantized by hand, stored in fp32."""
    suffix = "_scale" if compressed_tensors else "_scale_inv"
    shutil.copytree(src, dst)
    (shard,) = dst.glob("*.safetensors")
    quantized, dequantized = {}, {}
    for name, t in load_file(shard).items():
        if _is_projection(name, t):
            q, s = _quantized(t.float(), block)
            quantized[name], quantized[name + suffix] = q, s
            dequantized[name] = _by_hand(q, s, block)
        else:
            quantized[name] = dequantized[name] = t
    save_file(quantized, shard, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    if compressed_tensors:
        weights = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False,
                   "strategy": block if isinstance(block, str) else "block", "block_structure": None if isinstance(block, str) else list(block)}
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                                         "quantization_status": "compressed", "kv_cache_scheme": None, "config_groups": {"group_0": {
                                             "targets": ["Linear"], "weights": weights, "output_activations": None,
                                             "input_activations": {"type": "float", "num_bits": 8, "dynamic": True, "strategy": "token"}}}}
    else:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config))
    if plain is not None:
        shutil.copytree(src, plain)
        save_file(dequantized, next(plain.glob("*.safetensors")), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_greedy_matches_transformers_dequantized_model(family, family_models, tmp_path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from tests.engine.hf_reference import Reference

    path = fp8_copy(family_models.get(family), tmp_path / "fp8", (8, 8))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                              quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=(8, 8))).eval()
    outs = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16,
                                                                                                       ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False, output_logits=True,
                              return_dict_in_generate=True)
        gaps = [(lambda top: (top[0] - top[1]).item())(torch.log_softmax(s[0].float(), -1).topk(2).values) for s in ref.logits]
        assert_greedy_matches(o.outputs[0].token_ids, Reference(ref.sequences[0, len(p):].tolist(), gaps), f"{family} fp8")


def _logits(path: Path, dtype: str) -> torch.Tensor:
    runner = ModelRunner(path, device="cpu", dtype=dtype)
    runner.allocate_kv_cache(num_blocks=8, num_cpu_blocks=0, block_size=16)
    return runner.execute(Batch([SeqChunk(PROMPTS[1], 0, [0, 1, 2, 3], True)]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_partial_blocks_serve_the_weights_dequantized_by_hand(family_models, tmp_path, dtype):
    if dtype == "bfloat16":
        from qworker.model.linear import panels_supported

        if not panels_supported(torch.bfloat16)[0]:
            pytest.skip("the bf16 panels GEMM is unavailable on this CPU")
    plain = tmp_path / "plain"
    path = fp8_copy(family_models.get("deepseek_v3"), tmp_path / "fp8", (16, 24), plain=plain)  # 40- and 64-wide: partial blocks
    assert torch.equal(_logits(path, dtype), _logits(plain, dtype))


@pytest.mark.parametrize("strategy", ["channel", "tensor", (16, 24)])
def test_compressed_tensors_fp8_serves_the_weights_dequantized_by_hand(family_models, tmp_path, strategy):
    plain = tmp_path / "plain"
    path = fp8_copy(family_models.get("qwen3_moe"), tmp_path / "fp8", strategy, plain=plain, compressed_tensors=True)
    assert torch.equal(_logits(path, "float32"), _logits(plain, "float32"))


@pytest.mark.parametrize("group,why", [
    (dict(weights={"type": "int", "num_bits": 4, "strategy": "group"}), "only 8-bit float weights per tensor, channel or block"),
    (dict(weights={"type": "float", "num_bits": 8, "strategy": "channel"}, input_activations={"type": "float", "num_bits": 8, "dynamic": False}),
     "static activation scales are not supported"),
])
def test_compressed_tensors_schemes_not_served_are_refused(family_models, tmp_path, group, why):
    path = fp8_copy(family_models.get("llama"), tmp_path / "m", "channel", compressed_tensors=True)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"].update(group)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=why):
        ModelRunner(path, device="cpu", dtype="float32")


@pytest.mark.parametrize("change,why", [
    ("no_scales", "quantization_config says FP8, but the checkpoint holds no FP8 weight scales"),
    ("bad_scale_shape", "_scale_inv. has shape \\[2, 2\\], expected \\[8, 8\\]"),
    ("scale_without_weight", "without its weight"),
    ("fp8_without_scale", "is stored as FP8 without its scale"),
    ("static", "activation_scheme 'static' is not supported"),
    ("bad_block", "weight_block_size must be two positive integers"),
])
def test_malformed_fp8_checkpoints_are_refused_in_one_line(family_models, tmp_path, change, why):
    src = family_models.get("llama")
    if change == "no_scales":
        path = tmp_path / "m"
        shutil.copytree(src, path)
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [8, 8]}
        (path / "config.json").write_text(json.dumps(config))
    else:
        path = fp8_copy(src, tmp_path / "m", (8, 8))
        (shard,) = path.glob("*.safetensors")
        tensors = load_file(shard)
        name = "model.layers.0.self_attn.q_proj.weight"
        if change == "bad_scale_shape":
            tensors[f"{name}_scale_inv"] = torch.ones(2, 2)
        elif change == "scale_without_weight":
            tensors["model.layers.0.self_attn.extra.weight_scale_inv"] = torch.ones(1, 1)
        elif change == "fp8_without_scale":
            del tensors[f"{name}_scale_inv"]
        save_file(tensors, shard, metadata={"format": "pt"})
        config = json.loads((path / "config.json").read_text())
        if change == "static":
            config["quantization_config"]["activation_scheme"] = "static"
        elif change == "bad_block":
            config["quantization_config"]["weight_block_size"] = [8, 0]
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=why):
        ModelRunner(path, device="cpu", dtype="float32")


def test_a_block_larger_than_the_weight_is_a_scale_for_all_of_it(family_models, tmp_path):
    """helper-98: a weight_block_size of 2^28 expanded each scale to rows x 2^28 floats (64 GB)."""
    plain = tmp_path / "plain"
    path = fp8_copy(family_models.get("llama"), tmp_path / "fp8", (1 << 28, 1 << 28), plain=plain)
    assert torch.equal(_logits(path, "float32"), _logits(plain, "float32"))
