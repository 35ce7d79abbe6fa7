"""Arcee (AFM): Llama with a non-gated MLP ``down_proj(relu(up_proj(x)) ** 2)`` (``hidden_act``
``relu2``), biases where ``mlp_bias``. LoRA adapts q/k/v/o (the MLP is not gated, so it has no
fused gate/up projection to wrap)."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (ATTENTION_LORA, DecoderSpec, DenseMLP, RawLayer, activation, attention_biases, dims, llama_layer,
                                         mlp_bias, take, uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    inter = config.intermediate_size
    biases, with_bias = attention_biases(config), mlp_bias(config)

    def mlp(w, p):
        p += "mlp."
        return DenseMLP(take(w, f"{p}up_proj.weight", (inter, d.hidden)), take(w, f"{p}down_proj.weight", (d.hidden, inter)), gated=False,
                        up_bias=take(w, f"{p}up_proj.bias", (inter,)) if with_bias else None,
                        down_bias=take(w, f"{p}down_proj.bias", (d.hidden,)) if with_bias else None)

    def take_layer(w, i) -> RawLayer:
        return llama_layer(w, i, d, inter, mlp, biases=biases)

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), activation=activation(config), lora_modules=ATTENTION_LORA)
