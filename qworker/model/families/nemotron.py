"""Nemotron (Nemotron-4 and Minitron). What differs from Llama: LayerNorm with biases whose weight
counts from 1 (``LayerNorm1P``: ``(1 + w)``, folded into the weight at load; ``norm_eps``); a
non-gated MLP ``down_proj(relu(up_proj(x)) ** 2)`` with biases where ``mlp_bias``; q/k/v/o
biases where ``attention_bias``; rotary on the first ``partial_rotary_factor`` (0.5) of each head.
No window."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (ATTENTION_LORA, DecoderSpec, RawLayer, activation, attention_biases, dims, mlp_bias,
                                         take_attention, take_layer_norm, take_plain_mlp, uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    inter = config.intermediate_size
    with_bias = mlp_bias(config)
    biases = attention_biases(config)

    def take_layer(w, i):
        p = f"model.layers.{i}."
        mlp = take_plain_mlp(w, f"{p}mlp.up_proj", f"{p}mlp.down_proj", d.hidden, inter, with_bias)
        return RawLayer(input_norm=take_layer_norm(w, f"{p}input_layernorm", (d.hidden,), True),
                        mlp_norm=take_layer_norm(w, f"{p}post_attention_layernorm", (d.hidden,), True),
                        mlp=mlp, **take_attention(w, p, d, biases))

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), activation=activation(config), lora_modules=ATTENTION_LORA,
                       norm="layer", norm_plus_one=True, norm_eps=config.norm_eps, final_norm_bias=True, partial_rotary=True)
