"""OLMo 2 and OLMo 3 (AI2): no norm before attention or the MLP; each branch's output is normed
(``post_attention_layernorm``, ``post_feedforward_layernorm``) before its residual add, and an
RMSNorm runs over the full width of q and of k (before the head split), as OLMoE's. OLMo 2 masks
causally only; OLMo 3 slides on the layers ``layer_types`` marks "sliding_attention" and takes
each layer type's rope from ``rope_parameters``."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, attention_biases, dims, post_norm_layer, ropes_by_layer_type, typed_layers, uniform_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    biases = attention_biases(config)
    if config.model_type == "olmo3":
        rope_tables, layers = ropes_by_layer_type(config, typed_layers(config))
    else:
        rope_tables, layers = {None: None}, uniform_layers(config, None)
    return DecoderSpec(take_layer=lambda w, i: post_norm_layer(w, i, d, config.intermediate_size, "full", biases),
                       layers=layers, qk_norm="full", rope_tables=rope_tables)
