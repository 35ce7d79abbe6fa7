"""SmolLM3: Llama whose layers ``no_rope_layers`` marks 0 attend without rotary embeddings (NoPE:
q and k are not rotated; the others use the rope table); windows on the layers ``layer_types``
marks "sliding_attention" (transformers marks them only where ``use_sliding_window`` is set, and
its eager attention masks by ``layer_types`` alone)."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, LayerAttention, attention_biases, dims, llama_layer, mlp_bias, typed_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    biases = attention_biases(config)
    n = config.num_hidden_layers
    rotary = getattr(config, "no_rope_layers", None)
    rotary = [1] * n if rotary is None else list(rotary)
    if len(rotary) != n:
        raise ValueError(f"smollm3: config.no_rope_layers has {len(rotary)} entries for {n} layers")
    layers = [LayerAttention(sliding_window=a.sliding_window, rotary=bool(r)) for a, r in zip(typed_layers(config), rotary)]
    return DecoderSpec(take_layer=lambda w, i: llama_layer(w, i, d, config.intermediate_size, biases=biases, mlp_bias=mlp_bias(config)),
                       layers=layers)
