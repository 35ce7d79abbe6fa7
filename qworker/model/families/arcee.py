"""Arcee (AFM): Llama with a non-gated MLP ``down_proj(relu(up_proj(x)) ** 2)`` (``hidden_act``
``relu2``), biases where ``mlp_bias``. LoRA adapts q/k/v/o (the MLP is not gated, so it has no
fused gate/up projection to wrap)."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (ATTENTION_LORA, DecoderSpec, RawLayer, activation, attention_biases, dims, llama_layer, mlp_bias,
                                         take_plain_mlp, uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    inter = config.intermediate_size
    biases, with_bias = attention_biases(config), mlp_bias(config)

    def mlp(w, p):
        return take_plain_mlp(w, f"{p}mlp.up_proj", f"{p}mlp.down_proj", d.hidden, inter, with_bias)

    def take_layer(w, i) -> RawLayer:
        return llama_layer(w, i, d, inter, mlp, biases=biases)

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), activation=activation(config), lora_modules=ATTENTION_LORA)
