"""StableLM (StableLM 2, StableLM-3B-4E1T, Zephyr). What differs from Llama: LayerNorm with biases
(``layer_norm_eps``); q/k/v biases where ``use_qkv_bias``; rotary on the first
``partial_rotary_factor`` (0.25) of each head; with ``use_parallel_residual`` one norm a layer
whose output attention and the MLP both read (a parallel block); with ``qk_layernorm`` a
LayerNorm over each head of q and k, a weight per head (``self_attn.{q,k}_layernorm.norms.{h}``).
No window."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, RawLayer, dims, llama_layer, per_head_layer_norms, take_layer_norm,
                                         uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    parallel = bool(getattr(config, "use_parallel_residual", False))
    qk_norm = bool(getattr(config, "qk_layernorm", False))
    qkv_bias = bool(getattr(config, "use_qkv_bias", False))

    def take_layer(w, i):
        p = f"model.layers.{i}."
        layer: RawLayer = llama_layer(w, i, d, config.intermediate_size, biases=(qkv_bias, False), norms=False)
        layer.input_norm = take_layer_norm(w, f"{p}input_layernorm", (d.hidden,), True)
        layer.mlp_norm = None if parallel else take_layer_norm(w, f"{p}post_attention_layernorm", (d.hidden,), True)
        if qk_norm:
            layer.q_norm = per_head_layer_norms(w, f"{p}self_attn.q_layernorm", d.num_heads, d.head_dim)
            layer.k_norm = per_head_layer_norms(w, f"{p}self_attn.k_layernorm", d.num_kv_heads, d.head_dim)
        return layer

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), norm="layer", norm_eps=config.layer_norm_eps,
                       parallel_block=parallel, parallel_attention_first=True, final_norm_bias=True,
                       qk_norm="head_layer" if qk_norm else None, partial_rotary=True)
