"""OLMo 2 and OLMo 3 (AI2): no norm before attention or the MLP; each branch's output is normed
(``post_attention_layernorm``, ``post_feedforward_layernorm``) before its residual add, and an
RMSNorm runs over the full width of q and of k (before the head split), as OLMoE's. OLMo 2 masks
causally only; OLMo 3 slides on the layers ``layer_types`` marks "sliding_attention" and takes
each layer type's rope from ``rope_parameters``. FlexOlmo (``flex_olmo``): OLMo 2's layer with
OLMoE's MoE in every layer (softmax router, renormalised iff ``norm_topk_prob``)."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, MoEWeights, attention_biases, dims, post_norm_layer, ropes_by_layer_type, take,
                                         take_experts, typed_layers, uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    biases = attention_biases(config)
    if config.model_type == "olmo3":
        rope_tables, layers = ropes_by_layer_type(config, typed_layers(config))
    else:
        rope_tables, layers = {None: None}, uniform_layers(config, None)
    mlp = olmoe_moe(config, d.hidden) if config.model_type == "flex_olmo" else None
    return DecoderSpec(take_layer=lambda w, i: post_norm_layer(w, i, d, config.intermediate_size, "full", biases, mlp),
                       layers=layers, qk_norm="full", rope_tables=rope_tables)


def olmoe_moe(config: PretrainedConfig, hidden: int):
    """OLMoE's MoE block at ``{p}mlp.`` as a layer reader (FlexOlmo's MLP)."""
    E = config.num_experts

    def take_moe(w, p):
        gate_up, down = take_experts(w, f"{p}mlp.experts.", E, hidden, config.intermediate_size)
        return MoEWeights(take(w, f"{p}mlp.gate.weight", (E, hidden)), gate_up, down, config.num_experts_per_tok,
                          renormalize=bool(config.norm_topk_prob), weights_in_act_dtype=True)
    return take_moe
