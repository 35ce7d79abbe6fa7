"""EXAONE 4.0 (LG AI Research): OLMo 2's layer (no norm before attention or the MLP; each
branch's output normed, ``post_attention_layernorm`` / ``post_feedforward_layernorm``, before
its residual add) with Qwen3's RMSNorm over each head of q and k (before rope); windows on the
layers ``layer_types`` marks "sliding_attention", and in such a hybrid model the full-attention
layers take no rotary embeddings (NoPE). No biases."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, LayerAttention, RawLayer, dims, take, take_attention, take_dense_mlp, typed_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)

    def take_layer(w, i):
        p = f"model.layers.{i}."
        return RawLayer(
            input_norm=None,
            mlp_norm=None,
            attn_out_norm=take(w, f"{p}post_attention_layernorm.weight", (d.hidden,)),
            mlp_out_norm=take(w, f"{p}post_feedforward_layernorm.weight", (d.hidden,)),
            q_norm=take(w, f"{p}self_attn.q_norm.weight", (d.head_dim,)),
            k_norm=take(w, f"{p}self_attn.k_norm.weight", (d.head_dim,)),
            mlp=take_dense_mlp(w, f"{p}mlp.", d.hidden, config.intermediate_size),
            **take_attention(w, p, d, (False, False)),
        )

    # transformers rotates a layer's q and k unless the model has a window and the layer is not sliding
    hybrid = getattr(config, "sliding_window", None) is not None
    layers = [LayerAttention(sliding_window=a.sliding_window, rotary=not hybrid or a.sliding_window is not None) for a in typed_layers(config)]
    return DecoderSpec(take_layer=take_layer, layers=layers, qk_norm="head")
