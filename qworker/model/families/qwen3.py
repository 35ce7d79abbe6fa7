"""Qwen3: Llama with an RMSNorm over each head of q and k (before rope); windows by ``layer_types``."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, attention_biases, dims, llama_layer, take, typed_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)

    def take_layer(w, i):
        layer = llama_layer(w, i, d, config.intermediate_size, biases=attention_biases(config))
        p = f"model.layers.{i}.self_attn."
        layer.q_norm = take(w, f"{p}q_norm.weight", (d.head_dim,))
        layer.k_norm = take(w, f"{p}k_norm.weight", (d.head_dim,))
        return layer

    return DecoderSpec(take_layer=take_layer, layers=typed_layers(config), qk_norm="head")
