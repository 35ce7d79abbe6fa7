"""OLMoE: RMSNorm over the full width of q and of k (before the head reshape), optional
``clip_qkv`` after those norms, a sparse MoE in every layer (renormalised iff ``norm_topk_prob``).
No window: transformers' OLMoE masks causally only."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, MoEWeights, attention_biases, dims, llama_layer, take, take_experts,
                                         take_full_qk_norms, uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    E = config.num_experts

    def mlp(w, p):
        gate_up, down = take_experts(w, f"{p}mlp.experts.", E, d.hidden, config.intermediate_size)
        return MoEWeights(take(w, f"{p}mlp.gate.weight", (E, d.hidden)), gate_up, down, config.num_experts_per_tok,
                          renormalize=bool(config.norm_topk_prob), weights_in_act_dtype=True)

    def take_layer(w, i):
        return take_full_qk_norms(w, i, d, llama_layer(w, i, d, config.intermediate_size, mlp, biases=attention_biases(config)))

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), qk_norm="full",
                       clip_qkv=getattr(config, "clip_qkv", None))
