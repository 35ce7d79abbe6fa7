"""OLMo (the first OLMo: OLMo-1B/7B-hf). What differs from Llama: LayerNorm without weights or
biases (a fixed eps of 1e-5, as transformers' ``OlmoLayerNorm``), so no norm tensors in the
checkpoint; q, k and v clamped to ``[-clip_qkv, clip_qkv]`` where the config sets it. No window."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, attention_biases, dims, llama_layer, no_affine_norm, uniform_layers

EPS = 1e-5  # OlmoLayerNorm's, not read from the config


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    biases = attention_biases(config)
    no_affine = no_affine_norm(d.hidden)

    def take_layer(w, i):
        layer = llama_layer(w, i, d, config.intermediate_size, biases=biases, norms=False)
        layer.input_norm, layer.mlp_norm = no_affine, no_affine
        return layer

    clip = getattr(config, "clip_qkv", None)
    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), norm="layer", norm_eps=EPS, final_norm=None,
                       clip_qkv=float(clip) if clip is not None else None)
