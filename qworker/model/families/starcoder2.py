"""StarCoder 2. What differs from Llama: LayerNorm with biases (``norm_epsilon``) for the two
norms a layer and the final one; q/k/v/o biases and the MLP's where ``use_bias``; a non-gated MLP
``c_proj(act(c_fc(x)))`` (GELU, tanh approximation); ``sliding_window`` on every layer."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (ATTENTION_LORA, DecoderSpec, RawLayer, activation, dims, take_attention, take_layer_norm,
                                         take_plain_mlp, uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    inter = config.intermediate_size
    bias = bool(getattr(config, "use_bias", True))

    def take_layer(w, i):
        p = f"model.layers.{i}."
        mlp = take_plain_mlp(w, f"{p}mlp.c_fc", f"{p}mlp.c_proj", d.hidden, inter, bias)
        return RawLayer(input_norm=take_layer_norm(w, f"{p}input_layernorm", (d.hidden,), True),
                        mlp_norm=take_layer_norm(w, f"{p}post_attention_layernorm", (d.hidden,), True),
                        mlp=mlp, **take_attention(w, p, d, (bias, bias)))

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, getattr(config, "sliding_window", None)),
                       activation=activation(config), lora_modules=ATTENTION_LORA, norm="layer", norm_eps=config.norm_epsilon, final_norm_bias=True)
