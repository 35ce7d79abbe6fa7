"""SmolLM3: Llama whose layers ``no_rope_layers`` marks 0 attend without rotary embeddings (NoPE:
q and k are not rotated; the others use the rope table), and whose window applies only where
``use_sliding_window`` is set, on the layers ``layer_types`` marks "sliding_attention"."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, LayerAttention, attention_biases, dims, layer_types, llama_layer


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    n = config.num_hidden_layers
    rotary = list(getattr(config, "no_rope_layers", None) or [1] * n)
    types = layer_types(config)
    if len(rotary) != n:
        raise ValueError(f"smollm3: config.no_rope_layers has {len(rotary)} entries for {n} layers")
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
    layers = [LayerAttention(sliding_window=window if t == "sliding_attention" else None, rotary=bool(r))
              for t, r in zip(types, rotary)]
    return DecoderSpec(take_layer=lambda w, i: llama_layer(w, i, d, config.intermediate_size, biases=attention_biases(config)), layers=layers)
