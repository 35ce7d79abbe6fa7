"""Phi (Phi-1, Phi-1.5, Phi-2). What differs from Llama: one LayerNorm a layer (with bias) whose
output both attention and the MLP read, their outputs added to the residual together (a parallel
block); q/k/v and the output projection (``self_attn.dense``) with biases; a non-gated MLP
``fc2(act(fc1(x)))`` with biases (GELU, tanh approximation); rotary on the first
``partial_rotary_factor`` of each head; ``model.final_layernorm`` and an LM head with a bias.
``qk_layernorm`` (off in every released Phi) is refused. No window."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, RawLayer, activation, dims, take, take_layer_norm, take_plain_mlp, uniform_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    inter = config.intermediate_size
    if getattr(config, "qk_layernorm", False):
        raise ValueError("phi: qk_layernorm is not supported (no released Phi checkpoint uses it)")

    def take_layer(w, i):
        p = f"model.layers.{i}."
        sizes = (d.q_size, d.kv_size, d.kv_size)
        qkv = [take(w, f"{p}self_attn.{n}_proj.weight", (s, d.hidden)) for n, s in zip("qkv", sizes)]
        qkv_bias = [take(w, f"{p}self_attn.{n}_proj.bias", (s,)) for n, s in zip("qkv", sizes)]
        mlp = take_plain_mlp(w, f"{p}mlp.fc1", f"{p}mlp.fc2", d.hidden, inter, True)
        return RawLayer(input_norm=take_layer_norm(w, f"{p}input_layernorm", (d.hidden,), True), mlp_norm=None, mlp=mlp,
                        qkv=torch.cat(qkv), qkv_bias=torch.cat(qkv_bias),
                        o=take(w, f"{p}self_attn.dense.weight", (d.hidden, d.q_size)), o_bias=take(w, f"{p}self_attn.dense.bias", (d.hidden,)))

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), activation=activation(config),
                       lora_modules=("q_proj", "k_proj", "v_proj"), norm="layer", norm_eps=config.layer_norm_eps, parallel_block=True,
                       final_norm="model.final_layernorm", final_norm_bias=True, head_bias=True, partial_rotary=True)
