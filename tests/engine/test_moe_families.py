"""DeepSeek-V2/V3's latent attention (MLA), GLM-4.5's, dots.llm1's and Llama 4's checkpoints
beyond what every family runs (tests/engine/test_model_families.py checks their tokens against
transformers): the
multi-token-prediction layers their checkpoints carry are not read (and refused where the config
declares none), MLA's KV cache holds per-head k and v of the q/k head width, the CPU bf16 mode
serves MLA within bf16 rounding of fp32, and what is not supported (tensor parallelism and LoRA
under MLA, a head_dim other than the rope width) is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from qworker.model.batch import Batch, SeqChunk
from qworker.model.families.spec import dims
from qworker.model.lora.adapter import LoRAAdapterError, load_lora_adapter
from qworker.model.latent_attention import HeadPrefix, LatentQKV
from qworker.model.loader import load_config
from qworker.model.parallel.build import check_supported
from qworker.model.runner import ModelRunner
from tests.engine.family_models import build_family_model, family_config
from tests.engine.lora_support import make_peft_adapter

IDS = torch.randint(3, 4000, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def _logits(path, dtype: str = "float32") -> list[torch.Tensor]:
    runner = ModelRunner(path, device="cpu", dtype=dtype)
    runner.allocate_kv_cache(num_blocks=8, num_cpu_blocks=0, block_size=16)
    steps = [Batch([SeqChunk(IDS[:39], 0, [0, 1, 2], True)]), Batch([SeqChunk(IDS[39:], 39, [0, 1, 2], True)])]
    return [runner.execute(step) for step in steps]


def _with_prediction_layer(src, dst, declared: int):
    """``src`` plus a copy of its last layer stored as layer L (a multi-token-prediction layer,
    with the extra tensors such a layer has), ``num_nextn_predict_layers`` = ``declared``."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    L = config["num_hidden_layers"]
    (dst / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": declared}))
    (shard,) = dst.glob("*.safetensors")
    tensors = load_file(shard)
    extra = {k.replace(f"layers.{L - 1}.", f"layers.{L}."): v.clone() for k, v in tensors.items() if f"layers.{L - 1}." in k}
    extra[f"model.layers.{L}.eh_proj.weight"] = torch.randn(64, 128)
    extra[f"model.layers.{L}.enorm.weight"] = torch.ones(64)
    save_file({**tensors, **extra}, shard, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_multi_token_prediction_layers_are_not_read(family, family_models, tmp_path):
    path = family_models.get(family)
    served = _with_prediction_layer(path, tmp_path / "mtp", declared=1)
    for got, want in zip(_logits(served), _logits(path)):
        assert torch.equal(got, want)
    undeclared = _with_prediction_layer(path, tmp_path / "stray", declared=0)
    with pytest.raises(ValueError, match="tensors this family does not use: model.layers.3"):
        ModelRunner(undeclared, device="cpu", dtype="float32")


def test_ernie_prediction_tensors_are_not_read(family_models, tmp_path):
    """ERNIE 4.5 checkpoints store their multi-token-prediction parts as ``model.mtp_*`` (which
    transformers skips): served as the model without them; any other stray tensor is still refused."""
    path = family_models.get("ernie4_5_moe")
    served = shutil.copytree(path, tmp_path / "mtp")
    (shard,) = served.glob("*.safetensors")
    tensors = load_file(shard)
    mtp = {"model.mtp_block.0.self_attn.q_proj.weight": torch.randn(64, 64), "model.mtp_emb_norm.0.weight": torch.ones(64),
           "model.mtp_linear_proj.0.weight": torch.randn(64, 128)}
    save_file({**tensors, **mtp}, shard, metadata={"format": "pt"})
    for got, want in zip(_logits(served), _logits(path)):
        assert torch.equal(got, want)
    save_file({**tensors, "model.extra_norm.weight": torch.ones(64)}, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="tensors this family does not use: model.extra_norm.weight"):
        ModelRunner(served, device="cpu", dtype="float32")


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "glm4_moe_lite"])
def test_latent_attention_caches_per_head_k_and_v_of_the_qk_width(family, family_models):
    path = family_models.get(family)
    config = load_config(path)
    d = dims(config)
    assert (d.num_kv_heads, d.head_dim) == (config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim)
    runner = ModelRunner(path, device="cpu", dtype="float32")
    layer = runner.model.layers[1]
    assert type(layer.qkv) is LatentQKV
    # v narrower than the head (V2's test model): o reads each head's first v_dim channels
    assert (type(layer.o) is HeadPrefix) == (config.v_head_dim != d.head_dim)
    runner.allocate_kv_cache(num_blocks=4, num_cpu_blocks=0, block_size=16)
    k_cache, _ = runner.kv.layers[0]
    assert k_cache.shape[-2:] == (d.num_kv_heads, d.head_dim)


ROWS = list(range(12, 40, 3))  # prompt lengths whose next-token logits the bf16 check compares


def _row_logits(path, dtype: str) -> torch.Tensor:
    """The engine's next-token logits after each prefix ``IDS[:n]``, ``n`` in ROWS (one sequence each)."""
    runner = ModelRunner(path, device="cpu", dtype=dtype)
    runner.allocate_kv_cache(num_blocks=3 * len(ROWS), num_cpu_blocks=0, block_size=16)
    return runner.execute(Batch([SeqChunk(IDS[:n], 0, [3 * i, 3 * i + 1, 3 * i + 2], True) for i, n in enumerate(ROWS)]))


def _hf_row_logits(path, dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    with torch.inference_mode():
        return model(torch.tensor([IDS])).logits[0, [n - 1 for n in ROWS]].float()


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1", "llama4_text", "ernie4_5_moe",
                                    "hunyuan_v1_moe", "minimax_m2", "phimoe"])
def test_cpu_bf16_mode_serves_them_within_bf16_rounding(family, family_models):
    """Over ten prompt positions, the bf16 logits' median distance from fp32 is within 6% of the
    logits' scale, or within 1.5x of transformers' own bf16 model's median distance from its fp32
    one where bf16 rounding flips near-tie expert picks (on these random models with random
    choice biases transformers' bf16 moves the logits that far too: a MoE whose routing is a near
    tie is not a bf16-stable function, and which positions flip differs between the two; a
    median over positions, not one position's distance). A prefill then a decode step: finite
    fp32 logits, the same argmax where fp32's top two are clearly apart."""
    path = family_models.get(family)
    for bf, f32 in zip(_logits(path, "bfloat16"), _logits(path)):
        assert bf.dtype == torch.float32 and torch.isfinite(bf).all()
        scale = f32.abs().max().item()
        top2 = f32.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 0.1 * scale
        drift = (bf - f32).abs().max().item()
        assert drift > 0.06 * scale or torch.equal(bf.argmax(-1)[clear], f32.argmax(-1)[clear])
    f32 = _row_logits(path, "float32")
    drift = (_row_logits(path, "bfloat16") - f32).abs().amax(-1).median().item()
    if drift > 0.06 * f32.abs().max().item():
        hf_drift = (_hf_row_logits(path, torch.bfloat16) - _hf_row_logits(path, torch.float32)).abs().amax(-1).median().item()
        assert drift <= 1.5 * hf_drift, f"{family}: bf16 moved the logits {drift:.3f} (median; transformers' bf16: {hf_drift:.3f})"


def test_tensor_parallelism_under_latent_attention_is_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 is not supported for deepseek_v3: DeepSeek's multi-head latent attention"):
        check_supported(family_config("deepseek_v3"), 2)
    check_supported(family_config("glm4_moe"), 2)  # its attention splits as Llama's


def test_lora_under_latent_attention_is_refused_by_name(family_models, tmp_path):
    path = family_models.get("deepseek_v2")  # V2-Lite's layout has a q_proj: PEFT adapts it
    adapter = make_peft_adapter(path, tmp_path / "a", rank=4, target_modules=["q_proj"], seed=1)
    with pytest.raises(LoRAAdapterError, match="targets q_proj, which deepseek_v2 models do not have as a LoRA target"):
        load_lora_adapter(adapter, load_config(path), max_rank=8)


def test_a_head_dim_other_than_the_rope_width_is_refused(tmp_path, model_dir):
    with pytest.raises(ValueError, match="head_dim 16 differs from qk_rope_head_dim 8"):
        build_family_model("deepseek_v3", tmp_path / "m", model_dir, head_dim=16)
        ModelRunner(tmp_path / "m", device="cpu", dtype="float32")


@pytest.mark.parametrize("types", [["dense", "sparse"], ["dense", "moe", "sparse"]])
def test_mlp_layer_types_that_do_not_list_each_layer_are_refused(types):
    from qworker.model.families import spec_for

    with pytest.raises(ValueError, match="mlp_layer_types must list 'dense' or 'sparse' for each of the 3 layers"):
        spec_for(family_config("glm4_moe_lite", mlp_layer_types=types)).take_layer({}, 0)


@pytest.mark.parametrize("family,overrides", [
    ("deepseek_v2", dict(v_head_dim=40)),  # v wider than q/k (24): q and k padded instead of v
    ("deepseek_v3", dict(v_head_dim=24, rope_interleave=False, q_lora_rank=None)),  # v exactly as wide; V3 with q_proj
])
def test_other_head_widths_match_transformers(family, overrides, tmp_path, model_dir):
    from qworker import LLM, SamplingParams
    from tests.engine.family_reference import eager_greedy
    from tests.engine.hf_reference import assert_greedy_matches

    path = build_family_model(family, tmp_path / "m", model_dir, **overrides)
    assert dims(load_config(path)).head_dim == max(24, overrides["v_head_dim"])
    prompts = [IDS[:7], IDS[:40] * 2]
    outs = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20).generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                                                        ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert_greedy_matches(o.outputs[0].token_ids, eager_greedy(path, p, 12), f"{family} {overrides}, prompt of {len(p)}")


@pytest.mark.parametrize("family,overrides", [
    # helper-95: the shared experts' biases were dropped (V2's mlp_bias puts them on every MLP)
    ("deepseek_v2", dict(mlp_bias=True, first_k_dense_replace=0)),
    # helper-95: the latent norms took rms_norm_eps; transformers builds them with RMSNorm's 1e-6
    ("deepseek_v3", dict(rms_norm_eps=0.5)),
    ("glm4_moe_lite", dict(rms_norm_eps=0.5)),
    # helper-95: refused, though transformers runs them: zero-width shared experts, a stray mlp_bias
    ("deepseek_v3", dict(n_shared_experts=0)),
    ("glm4_moe", dict(n_shared_experts=0)),
    ("deepseek_v3", dict(mlp_bias=True)),
    # helper-102: moe_norm_min (the floor of the renormalising sum) was ignored
    ("ernie4_5_moe", dict(moe_norm_min=5.0)),
])
def test_configs_transformers_runs_match_it(family, overrides, tmp_path, model_dir):
    from qworker import LLM, SamplingParams
    from tests.engine.family_reference import eager_greedy, eager_last_logits
    from tests.engine.hf_reference import assert_greedy_matches

    path = build_family_model(family, tmp_path / "m", model_dir, **overrides)
    prompts = [IDS[:9], IDS + IDS[:30]]
    outs = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20).generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                                                        ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert_greedy_matches(o.outputs[0].token_ids, eager_greedy(path, p, 12), f"{family} {overrides}, prompt of {len(p)}")
    logits = _logits(path)[0]
    torch.testing.assert_close(logits[0], eager_last_logits(path, IDS[:39]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_neox"])
def test_enable_lora_on_a_family_without_lora_targets_is_refused_at_start(family, family_models):
    """helper-95: an MLA model with enable_lora failed deep in the LoRA wrappers (AttributeError)."""
    from qworker import LLM

    with pytest.raises(ValueError, match=f"enable_lora is not supported for {family} models: they have no LoRA target"):
        LLM(str(family_models.get(family)), dtype="float32", kv_cache_memory=8 << 20, enable_lora=True)


# family -> (its router's tensors in layer 1, a shared expert's tensor of layer 1, read in the model dtype)
ROUTERS = {
    "deepseek_v3": (["mlp.gate.weight", "mlp.gate.e_score_correction_bias"], "mlp.shared_experts.gate_proj.weight"),
    "glm4_moe": (["mlp.gate.weight", "mlp.gate.e_score_correction_bias"], "mlp.shared_experts.gate_proj.weight"),
    "dots1": (["mlp.gate.weight", "mlp.gate.e_score_correction_bias"], "mlp.shared_experts.gate_proj.weight"),
    "deepseek_v2": (["mlp.gate.weight"], "mlp.shared_experts.gate_proj.weight"),
    "ernie4_5_moe": (["mlp.gate.weight", "mlp.moe_statics.e_score_correction_bias"], "mlp.shared_experts.gate_proj.weight"),
    "hunyuan_v1_moe": (["mlp.gate.wg.weight"], "mlp.shared_mlp.gate_proj.weight"),
}


@pytest.mark.parametrize("family", sorted(ROUTERS))
def test_the_router_is_read_in_fp32_for_a_bf16_model(family, family_models):
    """helper-97: the loader cast every tensor to bf16, and V3's choice bias (kept in fp32 by
    transformers, as the gate) lost the bits that decide near picks (1.3% of tokens took other experts)."""
    from qworker.model.loader import load_state_dict

    path = family_models.get(family)
    weights = load_state_dict(path, torch.device("cpu"), torch.bfloat16)
    router, shared = ROUTERS[family]
    for name in router:
        assert weights[f"model.layers.1.{name}"].dtype == torch.float32, name
    assert weights[f"model.layers.1.{shared}"].dtype == torch.bfloat16


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "longrope"])
def test_phimoe_is_served_up_to_where_its_rope_scale_switches(rope_type, tmp_path, model_dir):
    """helper-106: Phi-3.5-MoE scales cos/sin by long_mscale past original_max_position_embeddings
    under every rope type but the default; only longrope's context was capped there, so a yarn or
    linear model served longer prompts with the short scale (logits 1-3 apart). Within the cap the
    model matches transformers; past it a prompt is refused."""
    from qworker import LLM, SamplingParams
    from qworker.engine.errors import InvalidRequestError
    from tests.engine.family_reference import eager_last_logits

    extra = dict(short_factor=[1.0] * 8, long_factor=[4.0] * 8) if rope_type == "longrope" else dict(factor=4.0)
    rope = dict(rope_type=rope_type, rope_theta=10000.0, short_mscale=1.1, long_mscale=1.25, original_max_position_embeddings=48, **extra)
    path = build_family_model("phimoe", tmp_path / "m", model_dir, rope_parameters=rope)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    assert llm.engine.max_model_len == 48
    with pytest.raises(InvalidRequestError, match="prompt_too_long|context"):
        llm.generate([IDS[:40] + IDS[:20]], SamplingParams(max_tokens=1))
    runner = ModelRunner(path, device="cpu", dtype="float32")
    runner.allocate_kv_cache(num_blocks=8, num_cpu_blocks=0, block_size=16)
    logits = runner.execute(Batch([SeqChunk(IDS[:39], 0, [0, 1, 2], True)]))
    torch.testing.assert_close(logits[0], eager_last_logits(path, IDS[:39]), rtol=1e-4, atol=1e-4)
