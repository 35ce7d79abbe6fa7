"""Qwen3-MoE and Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B). Layer ``i`` is sparse unless it is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (those keep a dense MLP of
``intermediate_size``). Router: softmax, top-k, renormalised iff ``norm_topk_prob``.

* Qwen3-MoE: Qwen3's attention (per-head q/k norms); one window for all layers (transformers
  builds one mask from ``sliding_window``, which it clears unless ``use_sliding_window``).
* Qwen2-MoE: Qwen2's attention (q/k/v biases as ``qkv_bias`` says, none on o; windows by
  ``layer_types``), and a shared expert of ``shared_expert_intermediate_size`` beside the routed
  ones that every token takes, weighted by ``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, MoEWeights, attention_biases, dims, llama_layer, take, take_dense_mlp, take_experts,
                                         typed_layers, uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    qwen2 = config.model_type == "qwen2_moe"
    E = config.num_experts
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense_only = set(getattr(config, "mlp_only_layers", None) or [])
    biases = attention_biases(config)

    def take_layer(w, i):
        sparse = i not in dense_only and E > 0 and (i + 1) % step == 0

        def mlp(w, p):
            if not sparse:
                return take_dense_mlp(w, f"{p}mlp.", d.hidden, config.intermediate_size)
            gate_up, down = take_experts(w, f"{p}mlp.experts.", E, d.hidden, config.moe_intermediate_size)
            moe = MoEWeights(take(w, f"{p}mlp.gate.weight", (E, d.hidden)), gate_up, down, config.num_experts_per_tok,
                             renormalize=bool(config.norm_topk_prob), weights_in_act_dtype=True)
            if qwen2:
                moe.shared = take_dense_mlp(w, f"{p}mlp.shared_expert.", d.hidden, config.shared_expert_intermediate_size)
                moe.shared_gate = take(w, f"{p}mlp.shared_expert_gate.weight", (1, d.hidden))
            return moe

        layer = llama_layer(w, i, d, config.intermediate_size, mlp, biases=biases)
        if not qwen2:
            p = f"model.layers.{i}.self_attn."
            layer.q_norm = take(w, f"{p}q_norm.weight", (d.head_dim,))
            layer.k_norm = take(w, f"{p}k_norm.weight", (d.head_dim,))
        return layer

    if qwen2:
        return DecoderSpec(take_layer=take_layer, layers=typed_layers(config))
    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, getattr(config, "sliding_window", None)), qk_norm="head")
