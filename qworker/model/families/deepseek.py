"""DeepSeek-V2 (``deepseek_v2``: V2, V2-Lite, DeepSeek-Coder-V2), DeepSeek-V3 (``deepseek_v3``:
V3, R1, Kimi K2, Moonlight in bf16 exports) and GLM-4.7-Flash (``glm4_moe_lite``: V3's layer,
its dense and sparse layers listed by ``mlp_layer_types``). What differs from Llama:

* multi-head latent attention (MLA, :mod:`qworker.model.latent_attention`): q through a low-rank
  pair with an RMSNorm between (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``; V2-Lite has one
  ``q_proj``), keys and values from a normed latent (``kv_a_proj_with_mqa``,
  ``kv_a_layernorm``, ``kv_b_proj``) plus one rotated key part all heads share; each head is
  ``qk_nope_head_dim + qk_rope_head_dim`` wide, its value ``v_head_dim``. Only the
  ``qk_rope_head_dim`` channels rotate, on interleaved pairs (V2 always, V3 where
  ``rope_interleave``): their rows are reordered at load to halves and moved to the front of each
  head. The softmax scale is the head width's, times YaRN's ``mscale_all_dim`` factor squared;
* the first ``first_k_dense_replace`` layers have a dense MLP, the rest a MoE with shared experts
  (``n_shared_experts`` of ``moe_intermediate_size``, one dense MLP every token takes). V2's
  router: softmax, top-k (``topk_method`` "greedy") or top-k within the best ``topk_group`` of
  ``n_group`` groups scored by their best expert ("group_limited_greedy"), weights not
  renormalised (transformers ignores ``norm_topk_prob`` there). V3's: sigmoid, experts picked by
  score plus ``e_score_correction_bias`` within the groups scored by their best two, weights
  renormalised where ``norm_topk_prob``; both times ``routed_scaling_factor``;
* checkpoints may carry multi-token-prediction layers after the last one (not read:
  :mod:`qworker.model.loader`).

Not supported here: tensor parallelism (refused: the latent projections are not split) and LoRA
(PEFT's MLA module names are not mapped; adapters are refused by name).
"""

from __future__ import annotations

import math

import torch
from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, LatentAttentionWeights, MoEWeights, RawLayer, Weights, dims, rotate_halves_not_pairs,
                                         take, take_dense_mlp, take_experts, uniform_layers)


# transformers builds q_a_layernorm and kv_a_layernorm without an eps: its RMSNorm default, whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_scale(config: PretrainedConfig) -> float:
    """The softmax scale: ``(nope + rope) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2``
    under a rope scaling with ``mscale_all_dim`` (DeepSeek's YaRN), as transformers computes it."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
        m = _mscale(params["factor"], params["mscale_all_dim"])
        scale = scale * m * m
    return scale


def _rope_first(t: torch.Tensor, heads: int, nope: int, rope: int, interleaved: bool) -> torch.Tensor:
    """Per head ``[nope | rope]`` rows -> ``[rope | nope]`` (the rope rows as halves where
    ``interleaved``: :func:`~qworker.model.families.spec.rotate_halves_not_pairs`)."""
    per_head = t.reshape(heads, nope + rope, *t.shape[1:])
    t = torch.cat([per_head[:, nope:], per_head[:, :nope]], dim=1).reshape(t.shape)
    return rotate_halves_not_pairs(t, nope + rope, rope) if interleaved else t


def take_latent_attention(w: Weights, p: str, config: PretrainedConfig, interleaved: bool) -> dict:
    """A layer's MLA tensors (``{p}self_attn.*``) as RawLayer's ``qkv``/``o`` fields."""
    H, hidden = config.num_attention_heads, config.hidden_size
    nope, rope, v = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    r, q_rank = config.kv_lora_rank, config.q_lora_rank
    bias = bool(getattr(config, "attention_bias", False))
    a = f"{p}self_attn."
    q_width = H * (nope + rope)
    if q_rank is None:
        q_a = q_a_bias = q_a_norm = None
        q_b = take(w, f"{a}q_proj.weight", (q_width, hidden))
    else:
        q_a = take(w, f"{a}q_a_proj.weight", (q_rank, hidden))
        q_a_bias = take(w, f"{a}q_a_proj.bias", (q_rank,)) if bias else None
        q_a_norm = take(w, f"{a}q_a_layernorm.weight", (q_rank,))
        q_b = take(w, f"{a}q_b_proj.weight", (q_width, q_rank))
    kv_a = take(w, f"{a}kv_a_proj_with_mqa.weight", (r + rope, hidden))
    kv_a_bias = take(w, f"{a}kv_a_proj_with_mqa.bias", (r + rope,)) if bias else None
    if interleaved:  # the shared rotated key's rows (after the latent's) as halves
        kv_a = torch.cat([kv_a[:r], rotate_halves_not_pairs(kv_a[r:], rope, rope)])
        kv_a_bias = None if kv_a_bias is None else torch.cat([kv_a_bias[:r], rotate_halves_not_pairs(kv_a_bias[r:], rope, rope)])
    latent = LatentAttentionWeights(
        q_a=q_a, q_a_bias=q_a_bias, q_a_norm=q_a_norm, q_b=_rope_first(q_b, H, nope, rope, interleaved),
        kv_a=kv_a, kv_a_bias=kv_a_bias, kv_a_norm=take(w, f"{a}kv_a_layernorm.weight", (r,)),
        kv_b=take(w, f"{a}kv_b_proj.weight", (H * (nope + v), r)), rope=rope, nope=nope, v_dim=v, norm_eps=LATENT_NORM_EPS)
    return {"qkv": latent, "qkv_bias": None, "o": take(w, f"{a}o_proj.weight", (hidden, H * v)),
            "o_bias": take(w, f"{a}o_proj.bias", (hidden,)) if bias else None}


def routed_moe(w: Weights, p: str, config: PretrainedConfig, hidden: int, v3_router: bool, mlp_bias: bool = False) -> MoEWeights:
    """A DeepSeek-style MoE block at ``{p}mlp.``: ``gate`` (the router; V3/GLM-4.5 with
    ``e_score_correction_bias``), stacked or per-expert ``experts``, ``shared_experts``."""
    E, inter = config.n_routed_experts, config.moe_intermediate_size
    gate_up, down = take_experts(w, f"{p}mlp.experts.", E, hidden, inter)
    groups = None
    if v3_router:
        groups = (config.n_group, config.topk_group, "top2")
    elif config.topk_method == "group_limited_greedy":
        groups = (config.n_group, config.topk_group, "max")
    elif config.topk_method != "greedy":
        raise ValueError(f"{config.model_type}: unsupported topk_method {config.topk_method!r}; supported: 'greedy', 'group_limited_greedy'")
    moe = MoEWeights(take(w, f"{p}mlp.gate.weight", (E, hidden)), gate_up, down, config.num_experts_per_tok,
                     renormalize=v3_router and bool(config.norm_topk_prob), weights_in_act_dtype=False,
                     scoring="sigmoid" if v3_router else "softmax",
                     choice_bias=take(w, f"{p}mlp.gate.e_score_correction_bias", (E,)) if v3_router else None,
                     groups=groups, routed_scale=float(config.routed_scaling_factor))
    if config.n_shared_experts:
        moe.shared = take_dense_mlp(w, f"{p}mlp.shared_experts.", hidden, inter * config.n_shared_experts, mlp_bias)
    else:  # transformers still builds (and saves) a zero-width shared expert, which adds nothing
        for name in [n for n in w if n.startswith(f"{p}mlp.shared_experts.") and w[n].numel() == 0]:
            w.pop(name)
    return moe


def sparse_layer(config: PretrainedConfig, i: int) -> bool:
    """Whether layer ``i`` has the MoE (else a dense MLP): as ``mlp_layer_types`` lists it
    (GLM-4.7-Flash), else from ``first_k_dense_replace`` on."""
    types = getattr(config, "mlp_layer_types", None)
    if types is not None:
        if len(types) != config.num_hidden_layers or not set(types) <= {"dense", "sparse"}:
            raise ValueError(f"{config.model_type}: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                             f"{config.num_hidden_layers} layers, got {types!r}")
        return types[i] == "sparse"
    return i >= config.first_k_dense_replace


def build(config: PretrainedConfig) -> DecoderSpec:
    if getattr(config, "head_dim", None) not in (None, config.qk_rope_head_dim):
        # transformers builds the rope table for head_dim channels and applies it to the rotated part
        raise ValueError(f"{config.model_type}: head_dim {config.head_dim} differs from qk_rope_head_dim {config.qk_rope_head_dim} "
                         "(the rope table's width; transformers sets one to the other)")
    d = dims(config)
    v3 = config.model_type != "deepseek_v2"  # V3's router and optional rope interleave
    interleaved = bool(getattr(config, "rope_interleave", True)) if v3 else True
    mlp_bias = not v3 and bool(getattr(config, "mlp_bias", False))  # V3's and GLM-4.7-Flash's MLPs never have biases

    def take_layer(w, i):
        p = f"model.layers.{i}."
        if sparse_layer(config, i):
            mlp = routed_moe(w, p, config, d.hidden, v3, mlp_bias)
        else:
            mlp = take_dense_mlp(w, f"{p}mlp.", d.hidden, config.intermediate_size, mlp_bias)
        return RawLayer(input_norm=take(w, f"{p}input_layernorm.weight", (d.hidden,)),
                        mlp_norm=take(w, f"{p}post_attention_layernorm.weight", (d.hidden,)), mlp=mlp,
                        **take_latent_attention(w, p, config, interleaved))

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), attn_scale=attention_scale(config),
                       rope_dim=config.qk_rope_head_dim, lora_modules=())
