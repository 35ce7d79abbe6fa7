"""Qwen3-MoE: Qwen3's attention; layer ``i`` is sparse unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0`` (those keep a dense MLP of ``intermediate_size``). Router:
softmax, top-k, renormalised iff ``norm_topk_prob``; one window for all layers (transformers
builds one mask from ``sliding_window``, which it clears unless ``use_sliding_window``)."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, MoEWeights, attention_biases, dims, llama_layer, take, take_dense_mlp, take_experts, uniform_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    E = config.num_experts
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense_only = set(getattr(config, "mlp_only_layers", None) or [])

    def take_layer(w, i):
        sparse = i not in dense_only and E > 0 and (i + 1) % step == 0

        def mlp(w, p):
            if not sparse:
                return take_dense_mlp(w, f"{p}mlp.", d.hidden, config.intermediate_size)
            gate_up, down = take_experts(w, f"{p}mlp.experts.", E, d.hidden, config.moe_intermediate_size)
            return MoEWeights(take(w, f"{p}mlp.gate.weight", (E, d.hidden)), gate_up, down, config.num_experts_per_tok,
                              renormalize=bool(config.norm_topk_prob), weights_in_act_dtype=True)

        layer = llama_layer(w, i, d, config.intermediate_size, mlp, biases=attention_biases(config))
        p = f"model.layers.{i}.self_attn."
        layer.q_norm = take(w, f"{p}q_norm.weight", (d.head_dim,))
        layer.k_norm = take(w, f"{p}k_norm.weight", (d.head_dim,))
        return layer

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, getattr(config, "sliding_window", None)), qk_norm="head")
