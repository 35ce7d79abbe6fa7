"""The model registry: ``model_type`` -> the family module that builds its :class:`DecoderSpec`.

Adding a family is one short module with a ``build(config) -> DecoderSpec`` and a line here."""

from __future__ import annotations

from typing import Callable

from transformers import PretrainedConfig

from qworker.model.families import (arcee, cohere, deepseek, exaone4, falcon, gemma, glm, glm4_moe, gpt2, gpt_neox, gpt_oss, gptj, granite,
                                    hunyuan, llama, llama4, minimax_m2, mixtral, nemotron, olmo, olmo2, olmoe, opt, pair_rotary, phi, phi3,
                                    phimoe, qwen3, qwen3_moe, smollm3, stablelm, starcoder2)
from qworker.model.families.spec import DecoderSpec

FAMILIES: dict[str, Callable[[PretrainedConfig], DecoderSpec]] = {
    "llama": llama.build,
    "llama4_text": llama4.build,
    "mistral": llama.build,
    "ministral": llama.build,
    "granite": granite.build,
    "granitemoe": granite.build,
    "granitemoeshared": granite.build,
    "smollm3": smollm3.build,
    "qwen2": llama.build,
    "qwen2_vl_text": llama.build,  # the language models of Qwen2-VL and Qwen2.5-VL (qworker.model.wrappers)
    "qwen2_5_vl_text": llama.build,
    "seed_oss": llama.build,
    "cwm": llama.build,
    "helium": pair_rotary.build,
    "ernie4_5": pair_rotary.build,
    "ernie4_5_moe": pair_rotary.build,
    "hunyuan_v1_dense": hunyuan.build,
    "hunyuan_v1_moe": hunyuan.build,
    "minimax_m2": minimax_m2.build,
    "flex_olmo": olmo2.build,
    "vaultgemma": gemma.build,
    "arcee": arcee.build,
    "qwen2_moe": qwen3_moe.build,
    "qwen3": qwen3.build,
    "qwen3_vl_text": qwen3.build,  # Qwen3-VL's language model
    "qwen3_moe": qwen3_moe.build,
    "mixtral": mixtral.build,
    "phimoe": phimoe.build,
    "olmoe": olmoe.build,
    "olmo": olmo.build,
    "olmo2": olmo2.build,
    "olmo3": olmo2.build,
    "exaone4": exaone4.build,
    "phi": phi.build,
    "phi3": phi3.build,
    "stablelm": stablelm.build,
    "starcoder2": starcoder2.build,
    "cohere": cohere.build,
    "cohere2": cohere.build,
    "gpt_neox": gpt_neox.build,
    "gpt2": gpt2.build,
    "gpt_bigcode": gpt2.build,
    "gptj": gptj.build,
    "falcon": falcon.build,
    "gpt_oss": gpt_oss.build,
    "opt": opt.build,
    "nemotron": nemotron.build,
    "gemma": gemma.build,
    "gemma2": gemma.build,
    "gemma3_text": gemma.build,
    "glm": glm.build,
    "glm4": glm.build,
    "glm4_moe": glm4_moe.build,
    "glm4_moe_lite": deepseek.build,
    "dots1": glm4_moe.build,
    "deepseek_v2": deepseek.build,
    "deepseek_v3": deepseek.build,
}
SUPPORTED = sorted(FAMILIES)
# model_type -> a checkpoint tensor's name as the family reads it (None: not read), for checkpoints named otherwise
CHECKPOINT_NAMES: dict[str, Callable[[str], str | None]] = {"gpt_neox": gpt_neox.checkpoint_name, "gpt2": gpt2.checkpoint_name,
                                                           "gpt_bigcode": gpt2.checkpoint_name, "gptj": gptj.checkpoint_name,
                                                           "opt": opt.checkpoint_name, "falcon": falcon.checkpoint_name,
                                                           "ernie4_5": pair_rotary.checkpoint_name, "ernie4_5_moe": pair_rotary.checkpoint_name}
# tensors transformers keeps in fp32 whatever the model dtype (its _keep_in_fp32_modules_strict), by
# name suffix: the loader reads them in fp32, so a bf16 model's router picks the experts transformers does
_ROUTER_FP32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
KEEP_FP32: dict[str, tuple[str, ...]] = {"deepseek_v2": ("mlp.gate.weight",), "hunyuan_v1_moe": ("mlp.gate.wg.weight",),
                                         "ernie4_5_moe": ("mlp.gate.weight", "e_score_correction_bias"),
                                         **dict.fromkeys(("deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1"), _ROUTER_FP32)}
SILU_NAMES = ("silu", "swish")  # transformers' names for x * sigmoid(x)


def spec_for(config: PretrainedConfig) -> DecoderSpec:
    build = FAMILIES.get(config.model_type)
    if build is None:
        raise ValueError(f"unsupported model type {config.model_type!r}; supported: {', '.join(SUPPORTED)}")
    spec = build(config)
    # the silu families read no activation name themselves: one they would silently replace is refused
    act = getattr(config, "hidden_act", None) or "silu"
    if spec.activation == "silu" and act not in SILU_NAMES:
        raise ValueError(f"{config.model_type}: unsupported hidden_act {act!r}; supported: {', '.join(map(repr, SILU_NAMES))}")
    return spec
