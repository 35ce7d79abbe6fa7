"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases, windows by
``layer_types``); layer ``i`` is sparse unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0`` (those keep a dense MLP of ``intermediate_size``). A sparse
layer routes as Qwen3-MoE (softmax, top-k, renormalised iff ``norm_topk_prob``) and adds a shared
expert of ``shared_expert_intermediate_size`` that every token takes, weighted by
``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, MoEWeights, dims, llama_layer, take, take_dense_mlp, take_experts, typed_layers


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
                              renormalize=bool(config.norm_topk_prob), weights_in_act_dtype=True,
                              shared=take_dense_mlp(w, f"{p}mlp.shared_expert.", d.hidden, config.shared_expert_intermediate_size),
                              shared_gate=take(w, f"{p}mlp.shared_expert_gate.weight", (1, d.hidden)))

        return llama_layer(w, i, d, config.intermediate_size, mlp, biases=(bool(getattr(config, "qkv_bias", True)), False))

    return DecoderSpec(take_layer=take_layer, layers=typed_layers(config))
