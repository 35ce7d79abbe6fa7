"""OLMo 2 and OLMo 3 (AI2): no norm before attention or the MLP; each branch's output is normed
(``post_attention_layernorm``, ``post_feedforward_layernorm``) before its residual add, and an
RMSNorm runs over the full width of q and of k (before the head split), as OLMoE's. OLMo 2 masks
causally only; OLMo 3 slides on the layers ``layer_types`` marks "sliding_attention" and takes
each layer type's rope from ``rope_parameters``."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, RawLayer, attention_biases, dims, ropes_by_layer_type, take, take_attention, take_dense_mlp,
                                         typed_layers, uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)

    def take_layer(w, i):
        p = f"model.layers.{i}."
        return RawLayer(
            input_norm=None,
            mlp_norm=None,
            attn_out_norm=take(w, f"{p}post_attention_layernorm.weight", (d.hidden,)),
            mlp_out_norm=take(w, f"{p}post_feedforward_layernorm.weight", (d.hidden,)),
            q_norm=take(w, f"{p}self_attn.q_norm.weight", (d.q_size,)),
            k_norm=take(w, f"{p}self_attn.k_norm.weight", (d.kv_size,)),
            mlp=take_dense_mlp(w, f"{p}mlp.", d.hidden, config.intermediate_size),
            **take_attention(w, p, d, attention_biases(config)),
        )

    if config.model_type == "olmo3":
        rope_tables, layers = ropes_by_layer_type(config, typed_layers(config))
    else:
        rope_tables, layers = {None: None}, uniform_layers(config, None)
    return DecoderSpec(take_layer=take_layer, layers=layers, qk_norm="full", rope_tables=rope_tables)
