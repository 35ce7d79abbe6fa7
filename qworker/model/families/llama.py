"""Llama, Mistral, Ministral, Qwen2, Seed-OSS and CWM: the plain decoder (Llama's, Seed-OSS's
and CWM's MLP biases where ``mlp_bias``; Seed-OSS's o bias as ``attention_out_bias`` says; CWM
has no attention biases). Mistral's ``sliding_window`` applies to every layer; Ministral's,
Qwen2's and CWM's only where ``config.layer_types`` says "sliding_attention" (transformers sets
Qwen2's from ``use_sliding_window`` and ``max_window_layers``, CWM's one full layer in four)."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, attention_biases, dims, llama_layer, mlp_bias, typed_layers, uniform_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    if config.model_type in ("qwen2", "ministral", "qwen2_vl_text", "qwen2_5_vl_text", "cwm"):
        layers = typed_layers(config)
    elif config.model_type == "mistral":  # one window for every layer (None when the config has none)
        layers = uniform_layers(config, getattr(config, "sliding_window", None))
    else:
        # transformers' Llama forward masks causally only, whatever "sliding_window" a config.json
        # carries (its generate, 5.24, applies such a stray window to decode steps but not to the
        # prompt: no consistent model to match); served as the forward runs it, the way it was trained
        layers = uniform_layers(config, None)
    biases, with_mlp_bias = attention_biases(config), mlp_bias(config)
    return DecoderSpec(take_layer=lambda w, i: llama_layer(w, i, d, config.intermediate_size, biases=biases, mlp_bias=with_mlp_bias),
                       layers=layers)
