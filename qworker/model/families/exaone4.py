"""EXAONE 4.0 (LG AI Research): OLMo 2's layer (no norm before attention or the MLP; each
branch's output normed before its residual add) with Qwen3's RMSNorm over each head of q and k
(before rope); windows on the layers ``layer_types`` marks "sliding_attention", and in such a
hybrid model the full-attention layers take no rotary embeddings (NoPE). No biases."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, LayerAttention, attention_biases, dims, post_norm_layer, typed_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    biases = attention_biases(config)
    # transformers rotates a layer's q and k unless the model has a window and the layer is not sliding
    hybrid = getattr(config, "sliding_window", None) is not None
    layers = [LayerAttention(sliding_window=a.sliding_window, rotary=not hybrid or a.sliding_window is not None) for a in typed_layers(config)]
    return DecoderSpec(take_layer=lambda w, i: post_norm_layer(w, i, d, config.intermediate_size, "head", biases),
                       layers=layers, qk_norm="head")
