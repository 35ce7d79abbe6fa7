"""Phi-3: the checkpoint stores q/k/v fused as ``qkv_proj`` and gate/up as ``gate_up_proj`` (gate
rows first); one window for every layer (``sliding_window``, 2047 in Phi-3-mini); rope scaling
and ``partial_rotary_factor`` through :mod:`qworker.model.rope`."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, DenseMLP, RawLayer, dims, take, uniform_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    inter = config.intermediate_size

    def take_layer(w, i):
        p = f"model.layers.{i}."
        return RawLayer(
            input_norm=take(w, f"{p}input_layernorm.weight", (d.hidden,)),
            qkv=take(w, f"{p}self_attn.qkv_proj.weight", (d.q_size + 2 * d.kv_size, d.hidden)),
            qkv_bias=None,
            o=take(w, f"{p}self_attn.o_proj.weight", (d.hidden, d.q_size)),
            o_bias=None,
            mlp_norm=take(w, f"{p}post_attention_layernorm.weight", (d.hidden,)),
            mlp=DenseMLP(take(w, f"{p}mlp.gate_up_proj.weight", (2 * inter, d.hidden)), take(w, f"{p}mlp.down_proj.weight", (d.hidden, inter))),
        )

    # q/k/v and gate/up are fused modules (qkv_proj, gate_up_proj): LoRA adapts o_proj and down_proj only
    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, getattr(config, "sliding_window", None)), partial_rotary=True,
                       lora_modules=("o_proj", "down_proj"))
