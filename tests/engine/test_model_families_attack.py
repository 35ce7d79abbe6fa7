"""Adversarial checks of the model families: configs the per-family tests do not build (other
head sizes and counts, windows, expert counts, rope variants, soft-caps), configs that must be
refused rather than served wrong, and checkpoints laid out as the Hub ships them (sharded with
an index, bf16 on disk, other formats' files beside them). Greedy outputs are compared with
transformers' fp32 eager model on the same tiny random checkpoint (divergence allowed only at
near-ties, :func:`tests.engine.hf_reference.assert_greedy_matches`)."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from qworker import LLM, SamplingParams
from qworker.model.families import spec_for
from qworker.model.runner import ModelRunner
from tests.engine.family_models import BASE, build_family_model
from tests.engine.family_reference import eager_greedy, eager_last_logits, eager_model
from tests.engine.hf_reference import Reference, assert_greedy_matches

MAX_TOKENS = 8
GEMMA3_LINEAR_8 = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            # one factor per rotated channel pair: head_dim 16, partial_rotary_factor 0.5 (the phi3 test config)
            "short_factor": [1.0 + 0.1 * i for i in range(4)], "long_factor": [2.0 + 0.3 * i for i in range(4)]}

# name -> (model_type, overrides of tests.engine.family_models' config)
MODELS: dict[str, tuple[str, dict]] = {
    # transformers' Llama ignores a "sliding_window" key in config.json (masks causally only)
    "llama_window_key": ("llama", dict(sliding_window=7, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "olmoe_window_key": ("olmoe", dict(sliding_window=7, num_experts=3, num_experts_per_tok=1)),
    # transformers' Gemma 3 never applies attn_logit_softcapping (only the final-logit one)
    "gemma3_softcaps": ("gemma3_text", dict(sliding_window=16, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                            num_key_value_heads=1, tie_word_embeddings=False)),
    "phi3_longrope": ("phi3", dict(sliding_window=None, max_position_embeddings=256, original_max_position_embeddings=64,
                                   rope_parameters=LONGROPE)),
    # head_dim != hidden / heads, odd head counts, kv heads 1 and == heads, the C kernels' head sizes
    "llama_hd32": ("llama", dict(hidden_size=48, head_dim=32, num_attention_heads=3, num_key_value_heads=1, intermediate_size=40,
                                 attention_bias=True, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                                       "original_max_position_embeddings": 32})),
    "mistral_hd80_w17": ("mistral", dict(sliding_window=17, head_dim=80, num_attention_heads=3, num_key_value_heads=1)),
    "qwen3_moe_all_experts": ("qwen3_moe", dict(num_experts=3, num_experts_per_tok=3, decoder_sparse_step=2, mlp_only_layers=[],
                                                moe_intermediate_size=20, norm_topk_prob=True, use_sliding_window=True,
                                                sliding_window=7, num_hidden_layers=4, attention_bias=True)),
    "gemma3_linear8": ("gemma3_text", dict(sliding_window=17, query_pre_attn_scalar=32, head_dim=32, rope_parameters=GEMMA3_LINEAR_8)),
    "gemma2_hd256": ("gemma2", dict(query_pre_attn_scalar=50, head_dim=256, num_attention_heads=2, num_key_value_heads=2,
                                    sliding_window=7, attn_logit_softcapping=20.0, intermediate_size=40)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_dir):
    """Builds each model of :data:`MODELS` on first use, once for this module."""
    root = tmp_path_factory.mktemp("attack-models")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            model_type, overrides = MODELS[name]
            built[name] = build_family_model(model_type, root / name, model_dir, seed=7, **overrides)
        return built[name]

    return get


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def prompts(name: str, lengths) -> list[list[int]]:
    rng = random.Random(name)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in lengths]


def forward_greedy(path, prompt: list[int], n: int) -> Reference:
    """Greedy steps of transformers' full forward (no KV cache). Where a config has a
    "sliding_window" its model does not mask with (Llama, OLMoE), transformers' generate keeps
    only the last window of keys in its cache anyway, so its decode steps follow neither the
    model's mask nor a window; the model's own forward is the reference there."""
    model, ids, gaps = eager_model(str(path)), list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0, -1].float(), -1)
            top = logp.topk(2)
            gaps.append((top.values[0] - top.values[1]).item())
            ids.append(int(top.indices[0]))
    return Reference(ids[len(prompt):], gaps)


def check(path, ps, outs, what, reference=eager_greedy):
    for p, o in zip(ps, outs):
        assert_greedy_matches(o.outputs[0].token_ids, reference(path, p, len(o.outputs[0].token_ids)),
                              f"{what}, prompt of {len(p)}")


def test_llama_ignores_a_sliding_window_key(models):
    """A Llama config.json with "sliding_window" (some Hub configs carry one): transformers' Llama
    attends causally over everything, so must qworker (it applied the window: other tokens from
    the first one). Likewise OLMoE, whose config accepts the key and whose mask ignores it."""
    for name in ("llama_window_key", "olmoe_window_key"):
        path = models(name)
        ps = prompts(name, (30, 60))
        outs = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20).generate(ps, greedy())
        check(path, ps, outs, f"{name}", reference=forward_greedy)


def test_gemma3_serves_final_softcap_but_not_attention_softcap(models):
    """Gemma 3's attention ignores attn_logit_softcapping (it capped the scores: other tokens)."""
    path = models("gemma3_softcaps")
    ps = prompts("gemma3_softcaps", (5, 30, 60))
    check(path, ps, LLM(str(path), dtype="float32", kv_cache_memory=8 << 20).generate(ps, greedy()), "gemma3 soft-caps")
    runner = ModelRunner(str(path), dtype="float32")
    from qworker.model.batch import Batch, SeqChunk

    runner.allocate_kv_cache(num_blocks=8, num_cpu_blocks=0, block_size=16)
    logits = runner.execute(Batch([SeqChunk(ps[1], 0, [0, 1], True)]))
    torch.testing.assert_close(logits[0].cpu(), eager_last_logits(path, ps[1]), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "olmoe", "phi3"])
def test_an_activation_other_than_silu_is_refused(model_type):
    """The SwiGLU families read no activation name: a "gelu" model was served with silu."""
    config = AutoConfig.for_model(model_type, **{**BASE, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match=f"{model_type}: unsupported hidden_act 'gelu'"):
        spec_for(config)


def test_untied_model_without_lm_head_is_refused(models, tmp_path):
    """tie_word_embeddings false and no lm_head.weight: transformers would use a random head; this
    served the embedding instead. Now one line naming the tensor."""
    src = models("llama_window_key")
    path = tmp_path / "no-head"
    shutil.copytree(src, path)
    weights = load_file(str(path / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
        ModelRunner(str(path), dtype="float32")


def test_sharded_bf16_checkpoint_with_index_and_foreign_files(models, tmp_path):
    """The layout of a Hub folder: bf16 shards named by model.safetensors.index.json, a rotary
    inv_freq buffer among the tensors, and Mistral's consolidated.safetensors (other tensor names)
    beside them. Only the indexed shards are read (the foreign file failed the load)."""
    src = models("mistral_hd80_w17")
    path = tmp_path / "sharded"
    path.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, path / f.name)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(str(src / "model.safetensors")).items()}
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(40)
    names = sorted(weights)
    weight_map = {}
    for i in range(3):
        shard = f"model-{i + 1:05d}-of-00003.safetensors"
        part = {n: weights[n].contiguous() for n in names[i::3]}
        save_file(part, str(path / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    save_file({"layers.0.attention.wq.weight": torch.zeros(2, 2)}, str(path / "consolidated.safetensors"))
    ps = prompts("sharded", (40,))
    check(path, ps, LLM(str(path), dtype="float32", kv_cache_memory=8 << 20).generate(ps, greedy()), "sharded bf16")


def test_longrope_context_ends_where_its_short_factors_stop_being_exact(models):
    """Past original_max_position_embeddings transformers re-rotates the whole sequence with the
    long factors, which cached keys cannot follow: the context is capped there (it served 256
    positions, with other tokens past 64)."""
    path = models("phi3_longrope")
    assert ModelRunner(str(path), dtype="float32").max_model_len == 64
    ps = prompts("phi3_longrope", (20, 56))
    check(path, ps, LLM(str(path), dtype="float32", kv_cache_memory=8 << 20).generate(ps, greedy()), "phi3 longrope")


@pytest.mark.parametrize("name", ["llama_hd32", "mistral_hd80_w17", "qwen3_moe_all_experts", "gemma3_linear8", "gemma2_hd256"])
def test_other_dimensions_match_under_preemption_and_chunking(models, name):
    """Dimensions and options the per-family models do not have, under a KV pool too small for
    the batch (recompute), 16-token prefill chunks and a shared prompt prefix."""
    path = models(name)
    cfg = json.loads((path / "config.json").read_text())
    block_bytes = 2 * cfg["num_hidden_layers"] * 16 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4
    ps = prompts(name, (5, 40, 70, 100))
    ps.append(ps[-1][:60] + prompts(name + "-tail", (30,))[0])
    blocks = -(-(100 + MAX_TOKENS) // 16) + 2
    llm = LLM(str(path), dtype="float32", kv_cache_memory=blocks * block_bytes, block_size=16, max_num_batched_tokens=16,
              swap_space=0)
    outs = llm.generate(ps, greedy())
    stats = llm.stats()
    assert stats["preemptions_recompute"] > 0 and stats["prefix_cache_hits"] > 0, stats
    check(path, ps, outs, name)


def test_config_transformers_rejects_is_one_line(models, tmp_path):
    """transformers validates configs as strict dataclasses and raises its own error type (not a
    ValueError), which escaped as a traceback; now one line with the reason."""
    from qworker.model.loader import load_config

    path = tmp_path / "bad-rope"
    path.mkdir()
    cfg = json.loads((models("phi3_longrope") / "config.json").read_text())
    cfg["rope_parameters"]["short_factor"] = [1.0] * 7
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json: .*short_factor field must have length 4, got 7") as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_quantized_checkpoint_is_refused_by_name(models, tmp_path):
    """A quantized checkpoint (GPTQ: packed integer weights with scales) was read as a plain one:
    now one line naming the quantization method (fine-grained FP8 is dequantized at load:
    tests/engine/test_fp8_checkpoints.py)."""
    path = tmp_path / "gptq"
    shutil.copytree(models("llama_window_key"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quantized checkpoints are not supported \\(quantization_config: gptq\\)"):
        ModelRunner(str(path), dtype="float32")


def _rewrite_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "olmo2"])
def test_attention_biases_the_config_does_not_give_are_refused(model_type, model_dir, tmp_path):
    """A checkpoint with q/k/v/o biases under a config saying ``attention_bias: false`` (a Qwen2
    export relabelled "llama"): transformers builds bias-free projections and drops the tensors;
    qworker took them "where present" and served a third model. Now they are refused by name, and
    a bias the config gives but the checkpoint lacks is a missing tensor."""
    path = build_family_model(model_type, tmp_path / "biased", model_dir, seed=7, attention_bias=True)
    _rewrite_config(path, attention_bias=False)
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.0\.self_attn\.[kqvo]_proj\.bias.*attention_bias"):
        ModelRunner(str(path), dtype="float32")
    plain = build_family_model(model_type, tmp_path / "plain", model_dir, seed=7, attention_bias=False)
    _rewrite_config(plain, attention_bias=True)
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        ModelRunner(str(plain), dtype="float32")


def test_an_o_bias_qwen2_does_not_have_is_refused(model_dir, tmp_path):
    """transformers' Qwen2 gives q/k/v biases and never an o bias: a stored ``o_proj.bias`` was served."""
    path = build_family_model("qwen2", tmp_path / "qwen2", model_dir, seed=7)
    weights = load_file(str(path / "model.safetensors"))
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.randn(BASE["hidden_size"])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.0\.self_attn\.o_proj\.bias"):
        ModelRunner(str(path), dtype="float32")


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                                  {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}])
def test_partial_rotary_with_a_scaled_rope_is_refused_where_whole_heads_rotate(rope, model_dir, tmp_path):
    """Llama rotates whole heads (it ignores ``partial_rotary_factor`` with the default rope); with a
    scaled rope transformers' rope functions build a half-width table its attention cannot apply,
    and qworker rotated half of each head: a model nobody defines. Now refused in one line."""
    path = build_family_model("llama", tmp_path / rope["rope_type"], model_dir, seed=7, partial_rotary_factor=0.5, rope_parameters=rope)
    with pytest.raises(ValueError, match=f"partial_rotary_factor with rope_type '{rope['rope_type']}' is not supported"):
        ModelRunner(str(path), dtype="float32")
    default = build_family_model("llama", tmp_path / "default", model_dir, seed=7, partial_rotary_factor=0.5,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert ModelRunner(str(default), dtype="float32").model.rope.rotary_dim == BASE["head_dim"]


def test_smollm3_slides_where_layer_types_say_even_without_use_sliding_window(model_dir, tmp_path):
    """helper-83: transformers' eager attention masks by ``layer_types`` alone; qworker applied
    SmolLM3's window only where ``use_sliding_window`` was set too, and answered other tokens."""
    path = build_family_model("smollm3", tmp_path / "m", model_dir, seed=7, use_sliding_window=False, sliding_window=24,
                              layer_types=["sliding_attention"] * 3, no_rope_layers=[1, 0, 1])
    ps = prompts("smollm3-window", [47, 70])
    check(path, ps, LLM(str(path), dtype="float32", kv_cache_memory=8 << 20).generate(ps, greedy()), "smollm3 window by layer_types")


@pytest.mark.parametrize("model_type,change,message", [
    ("smollm3", dict(no_rope_layers=[]), "no_rope_layers has 0 entries for 3 layers"),
    ("smollm3", dict(sliding_window=None, layer_types=["full_attention", "sliding_attention", "full_attention"]),
     "marks layer 1 sliding, but sliding_window is None"),
    ("olmo3", dict(sliding_window=None), "marks layer 0 sliding, but sliding_window is None"),
    ("olmo3", dict(layer_types=["full_attention", "chunked_attention", "sliding_attention"]), "unsupported layer type 'chunked_attention'"),
    ("granite", dict(logits_scaling=float("inf")), "logits_scaling must be a finite number"),
    ("granite", dict(attention_multiplier=float("nan")), "attention_multiplier must be a finite number"),
])
def test_configs_transformers_cannot_run_are_refused_in_one_line(model_type, change, message, model_dir, tmp_path):
    """helper-83: these loaded and served (full attention, rope on every layer, token 0 for every
    job) where transformers raises or answers garbage; now one line naming the field."""
    path = build_family_model(model_type, tmp_path / "m", model_dir, seed=7)
    _rewrite_config(path, **change)
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelRunner(str(path), dtype="float32")
