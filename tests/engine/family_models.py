"""Tiny random models, one per supported family, built from each family's own transformers config
(a few layers, hidden 64, the test model's tokenizer and vocabulary) and saved with safetensors.

The init is not transformers' default (std 0.02 makes logits nearly flat, so greedy steps would
be near-ties): matrices are normal with std ``fan_in ** -0.5`` (times a gain for q and o, see
:func:`_randomize`), norms ``1 + N(0, 0.1)``, biases N(0, 0.1). Windows are small (24-40) so that
the test prompts run past them; the soft-caps are small enough to change scores and logits.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VOCAB = 49152
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2)

# model_type -> config overrides; the window each family applies is noted
FAMILY_CONFIGS: dict[str, dict] = {
    "llama": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(sliding_window=24),  # every layer
    "llama_mlp_bias": dict(mlp_bias=True, attention_bias=True),  # biases on every projection
    "seed_oss": dict(attention_bias=True, attention_out_bias=True, mlp_bias=True),  # no window
    "arcee": dict(mlp_bias=True),  # relu2 non-gated MLP; no window
    "qwen2": dict(use_sliding_window=True, sliding_window=24, max_window_layers=1, tie_word_embeddings=True),  # layers >= 1
    "qwen3": dict(use_sliding_window=True, sliding_window=32, max_window_layers=1),  # layers >= 1
    "qwen2_moe": dict(MOE, num_experts=4, moe_intermediate_size=48, shared_expert_intermediate_size=80, decoder_sparse_step=1,
                      mlp_only_layers=[2], norm_topk_prob=True, use_sliding_window=True, sliding_window=24,
                      max_window_layers=1),  # the layers transformers marks sliding from these (layer 0 here)
    "qwen3_moe": dict(MOE, num_experts=4, moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1],
                      norm_topk_prob=False, use_sliding_window=True, sliding_window=40),  # every layer
    "mixtral": dict(MOE, num_local_experts=4, sliding_window=24),  # every layer
    "olmoe": dict(MOE, num_experts=4, norm_topk_prob=True, clip_qkv=2.5),  # no window in transformers' OLMoE
    "phi3": dict(sliding_window=32, partial_rotary_factor=0.5, original_max_position_embeddings=1024),  # every layer
    "exaone4": dict(sliding_window=24, sliding_window_pattern=3),  # layers 0, 1 slide; layer 2 full and NoPE
    "gemma": dict(tie_word_embeddings=True),  # no window in transformers' Gemma
    "glm": dict(),  # attention_bias and partial_rotary_factor 0.5 by default; no window
    "glm4": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),  # no window
    "starcoder2": dict(sliding_window=24, norm_epsilon=1e-5),  # every layer; LayerNorm, non-gated GELU MLP, biases
    "phi": dict(hidden_act="gelu_new", rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                bos_token_id=1, eos_token_id=2),  # parallel block, biases everywhere, a head bias; no window
    "stablelm": dict(use_qkv_bias=True, qk_layernorm=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),  # no window
    "stablelm_parallel": dict(use_parallel_residual=True),  # the parallel block (built as "stablelm")
    "cohere": dict(use_qk_norm=True, logit_scale=0.5, tie_word_embeddings=True),  # parallel block, interleaved rope; no window
    "cohere2": dict(sliding_window=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    logit_scale=0.25, attention_bias=True),  # layer 1 full and NoPE
    "gpt_neox": dict(layer_norm_eps=1e-5,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),  # parallel; no window
    "gpt_neox_sequential": dict(use_parallel_residual=False, tie_word_embeddings=True),
    "nemotron": dict(mlp_bias=True, attention_bias=True, norm_eps=1e-5),  # LayerNorm1P, relu2 MLP, partial rotary 0.5; no window
    "gpt2": dict(n_inner=96, activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True),  # absolute positions
    "gpt_bigcode": dict(n_inner=96, multi_query=True, tie_word_embeddings=True),  # one k/v head for all
    "gpt_bigcode_mha": dict(n_inner=96, multi_query=False, tie_word_embeddings=True),  # per-head fused q/k/v
    "gptj": dict(rotary_dim=8, n_inner=96, activation_function="gelu_new"),  # interleaved rotary on 8 of 16 channels; parallel
    "opt": dict(ffn_dim=96, word_embed_proj_dim=64),  # learned positions (offset 2), ReLU MLP, biases; no window
    "opt_no_affine": dict(ffn_dim=96, word_embed_proj_dim=64, layer_norm_elementwise_affine=False, enable_bias=False),
    "gpt_oss": dict(MOE, num_local_experts=4, sliding_window=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    swiglu_limit=0.5),  # sinks, biases everywhere, clamped SwiGLU (a limit the test activations reach)
    "granite": dict(embedding_multiplier=4.0, attention_multiplier=0.4, residual_multiplier=0.5, logits_scaling=2.5),  # no window
    "granitemoe": dict(MOE, num_local_experts=4, embedding_multiplier=2.0, attention_multiplier=0.3, residual_multiplier=0.7,
                       logits_scaling=1.5),  # no window
    "granitemoeshared": dict(MOE, num_local_experts=4, shared_intermediate_size=80, embedding_multiplier=3.0, residual_multiplier=0.6),
    "ministral": dict(sliding_window=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "olmo": dict(clip_qkv=3.0, tie_word_embeddings=True),  # LayerNorm without weights; no window
    "olmo2": dict(),  # no window
    "olmo3": dict(sliding_window=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 256}}),
    "smollm3": dict(no_rope_layers=[1, 0, 1], use_sliding_window=True, sliding_window=24),  # layer 1: NoPE, sliding
    "gemma2": dict(sliding_window=24, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                   tie_word_embeddings=True),  # layers 0 and 2 (transformers' alternating default)
    "gemma3_text": dict(sliding_window=24, query_pre_attn_scalar=16, tie_word_embeddings=True,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # DeepSeek-V3's router (sigmoid, choice bias, 2 of 4 groups by their best two), q/k/v biases, qk norms, rotary on half of each head
    "glm4_moe": dict(MOE, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2,
                     routed_scaling_factor=1.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True, num_nextn_predict_layers=0),
    # MLA with q_proj (V2-Lite), interleaved rotary on 8 of 24 channels, v 16 wide; softmax router, groups by their best expert
    "deepseek_v2": dict(MOE, n_routed_experts=8, n_shared_experts=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=4,
                        topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5, q_lora_rank=None, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=16, num_key_value_heads=4),
    # MLA with the q_a/q_b pair and YaRN (mscale_all_dim); sigmoid router with a choice bias, 2 of 4 groups
    "deepseek_v3": dict(MOE, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=4,
                        topk_group=2, routed_scaling_factor=2.0, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        head_dim=8, v_head_dim=24, num_key_value_heads=4, num_nextn_predict_layers=0,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
                                         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # V3's MLA and router; dense and sparse layers by mlp_layer_types; rotary in halves (rope_interleave off)
    "glm4_moe_lite": dict(MOE, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, n_group=2, topk_group=1,
                          routed_scaling_factor=1.8, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8,
                          v_head_dim=16, num_key_value_heads=4, rope_interleave=False, mlp_layer_types=["dense", "sparse", "dense"]),
    # interleaved rotary on layers 0 and 2 (attending in chunks of 32), layer 1 NoPE with q scaled by position from position 7;
    # weightless q/k norms;
    # layer 1 a MoE (inputs weighed by sigmoid scores, a shared expert), the others dense MLPs of intermediate_size_mlp
    "llama4_text": dict(MOE, num_local_experts=4, intermediate_size=32, intermediate_size_mlp=96, interleave_moe_layer_step=2,
                        no_rope_layers=[1, 0, 1], floor_scale=8, attn_scale=0.5, use_qk_norm=True, attention_chunk_size=32,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    # Qwen3 attention (windows on layers >= max_window_layers), V3's router without groups
    "dots1": dict(MOE, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=1.5,
                  norm_topk_prob=True, sliding_window=24, max_window_layers=1, attention_bias=True),
    "cwm": dict(sliding_window=24, layer_types=["full_attention", "sliding_attention", "sliding_attention"], mlp_bias=True),
    "helium": dict(attention_bias=True, mlp_bias=True),  # rotary on interleaved pairs; no window
    "ernie4_5": dict(use_bias=True, tie_word_embeddings=True),  # interleaved rotary, biases on every projection; no window
    # interleaved rotary; layers 1 and 2 MoE (softmax router, a choice bias, a shared expert); biases, an LM-head bias
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=48, moe_num_shared_experts=1, moe_layer_start_index=1,
                         use_bias=True, tie_word_embeddings=False),
    # q/k norms after the rotation; Hunyuan's NTK-alpha rope base; biases on the attention projections
    "hunyuan_v1_dense": dict(attention_bias=True, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0, "factor": 1.0}),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, intermediate_size=48),  # a MoE with a shared MLP in every layer
    # full-width q/k norms, rotary on 8 of 16 channels; a sigmoid router with a choice bias in every layer
    "minimax_m2": dict(MOE, num_local_experts=4, intermediate_size=48, rotary_dim=8),
    "flex_olmo": dict(MOE, num_experts=4, norm_topk_prob=True),  # OLMo 2's layer with OLMoE's MoE; no window
    # the new decoder architecture (40B/180B): q/k/v by KV group, two norms a layer (ln_attn, ln_mlp), a parallel block
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=96, layer_norm_epsilon=1e-5),
    "falcon_7b": dict(new_decoder_architecture=False, multi_query=True, parallel_attn=True, ffn_hidden_size=96),  # multi-query, one norm
    "falcon_sequential": dict(new_decoder_architecture=False, multi_query=False, parallel_attn=False, bias=True, ffn_hidden_size=96,
                              tie_word_embeddings=False),  # q/k/v per head, biases, post_attention_layernorm
    # LayerNorm, biases on q/k/v/o and the head, a window on every layer, SparseMixer top-2 (a wide band: several
    # experts in each pick's softmax), longrope's short factors with short_mscale
    "phimoe": dict(MOE, num_local_experts=4, sliding_window=24, attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3,
                   rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
                                    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0], "short_mscale": 1.1, "long_mscale": 1.25,
                                    "original_max_position_embeddings": 1024}),
    "vaultgemma": dict(sliding_window=24, query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                       tie_word_embeddings=True),  # Gemma 2 without the output norms; layers 0 and 2 slide
}
FAMILIES = sorted(FAMILY_CONFIGS)


# test variants of a family: key in FAMILY_CONFIGS -> the model_type it is
VARIANTS = {"falcon_7b": "falcon", "falcon_sequential": "falcon", "llama_mlp_bias": "llama", "opt_no_affine": "opt", "stablelm_parallel": "stablelm", "gpt_neox_sequential": "gpt_neox", "gpt_bigcode_mha": "gpt_bigcode"}


def family_config(model_type: str, **overrides):
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    kind = VARIANTS.get(model_type, model_type)
    # a BASE field the family derives itself (Falcon's head_dim property) is not passed
    base = {k: v for k, v in BASE.items() if not isinstance(getattr(CONFIG_MAPPING[kind], k, None), property)}
    return AutoConfig.for_model(kind, **{**base, **FAMILY_CONFIGS[model_type], **overrides})


def _randomize(model: torch.nn.Module, gemma: bool, gen: torch.Generator, hidden: int | None = None) -> None:
    """Weights under which attention decides the output: with transformers' init (or plain
    ``fan_in ** -0.5`` everywhere) the token's own embedding dominates the residual stream, so a
    wrong window, rope base or soft-cap would still give the same greedy tokens. Here q is scaled
    up (sharp attention, scores large enough for a soft-cap to bite), o up, embeddings down."""
    hidden = hidden or model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.numel() == 0:  # DeepSeek's zero-width shared expert (n_shared_experts=0)
                continue
            if name.endswith("e_score_correction_bias"):  # a router's choice bias (ERNIE 4.5 MoE stores it [1, E])
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "embed" in name:  # Gemma multiplies embeddings by sqrt(hidden): start them that much smaller
                std = 0.5 * (hidden**-0.5 if gemma else 1.0)
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif p.dim() >= 2:  # [out, in] linears and [E, ...] stacked experts
                gain = 3.0 if "q_proj" in name or "qkv_proj" in name else 2.0 if "o_proj" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * gain * p.shape[-1] ** -0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:  # a norm weight; a normed q is scaled up like q_proj (Gemma uses 1 + w)
                mean = 3.0 if "q_norm" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1 + (mean - 1.0 if gemma else mean))
        for name, b in model.named_buffers():  # DeepSeek-V3's and MiniMax-M2's choice bias is a buffer (zeros by default)
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def build_family_model(model_type: str, out: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Writes a tiny random ``model_type`` model (config, safetensors, tokenizer) to ``out``."""
    from transformers import AutoModelForCausalLM

    config = family_config(model_type, **overrides)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, "gemma" in model_type, torch.Generator().manual_seed(seed))
    model.eval().save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out


# image-text checkpoints (qworker.model.wrappers): model_type -> (its language model: a family test
# model's name or a text config, the wrapper's own config: a one- or two-layer vision tower, tie
# flags as the case wants them)
MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
IMAGE_TEXT_CONFIGS: dict[str, tuple[str | dict, dict]] = {
    "gemma3": ("gemma3_text", dict(mm_tokens_per_image=4, vision_config=dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8))),
    # Llama 4's vision model and projector (not read), a Llama 4 language model with its MoE and NoPE layers
    "llama4": ("llama4_text", dict(tie_word_embeddings=False, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8,
        vision_output_dim=32, projector_input_dim=32, projector_output_dim=64, pixel_shuffle_ratio=0.5))),
    # untied: the head is stored as language_model.lm_head
    "mistral3": ("mistral", dict(tie_word_embeddings=False, vision_config=dict(
        model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
        image_size=32, patch_size=8))),
    # the text config says untied, the wrapper tied: transformers 5 ties by the wrapper's flag
    "llava": ("llama", dict(tie_word_embeddings=True, vision_config=dict(
        model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8, projection_dim=16))),
    # Aya Vision: a Command R7B (cohere2) language model under a SigLIP tower
    "aya_vision": ("cohere2", dict(tie_word_embeddings=True, downsample_factor=2, vision_config=dict(
        model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=32, patch_size=8))),
    # InternVL 3: a Qwen2 language model under InternViT
    "internvl": ("qwen2", dict(tie_word_embeddings=True, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=[32, 32], patch_size=[8, 8]))),
    # multimodal rope over the text model's 8 frequency pairs (text-only prompts: plain rope)
    "qwen2_5_vl": (dict(BASE, model_type="qwen2_5_vl_text", rope_parameters=MROPE), dict(tie_word_embeddings=False, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, fullatt_block_indexes=[0]))),
    "qwen3_vl": (dict(BASE, model_type="qwen3_vl_text", rope_parameters=MROPE), dict(tie_word_embeddings=False, vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, deepstack_visual_indexes=[0],
        num_position_embeddings=64))),
}
IMAGE_TEXT = sorted(IMAGE_TEXT_CONFIGS)


def build_image_text_model(model_type: str, out: Path, tokenizer_dir: Path, seed: int = 0, save_original_format: bool = True,
                           text_family: str | None = None) -> Path:
    """Writes a tiny random image-text ``model_type`` checkpoint whose language model is the tiny
    model of its family (:data:`FAMILY_CONFIGS`; ``text_family``: another one's), as transformers saves it."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text, wrapper = IMAGE_TEXT_CONFIGS[model_type]
    text = family_config(text_family or text).to_dict() if text_family or isinstance(text, str) else text
    config = AutoConfig.for_model(model_type, text_config=text, **wrapper)
    config._attn_implementation = "eager"
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    _randomize(model, text["model_type"].startswith("gemma"), torch.Generator().manual_seed(seed), hidden=BASE["hidden_size"])
    model.eval().save_pretrained(out, safe_serialization=True, save_original_format=save_original_format)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    return out
