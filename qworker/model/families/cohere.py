"""Cohere (Command R, ``cohere``) and Cohere 2 (Command R7B and Command A, ``cohere2``). What
differs from Llama:

* one LayerNorm a layer (weight only, ``layer_norm_eps``) whose output both attention and the
  MLP read, their outputs added to the residual together (a parallel block); the final norm a
  LayerNorm too;
* rotary embeddings on interleaved channel pairs (2j, 2j+1), served by reordering each head's q
  and k rows at load as for GLM (:func:`~qworker.model.families.spec.rotate_halves_not_pairs`);
* logits times ``logit_scale``; the LM head tied by default;
* Cohere with ``use_qk_norm`` (Command R+): a LayerNorm over each head of q and k, a weight per
  head (``self_attn.{q,k}_norm.weight``, ``[heads, head_dim]``), reordered with the rows;
* Cohere 2: windows on the layers ``layer_types`` marks sliding, and only those rotate: the
  full-attention layers take no rotary embeddings (NoPE), as transformers' Cohere 2.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, LayerAttention, RawLayer, attention_biases, dims, llama_layer,
                                         reorder_qk, rotate_halves_not_pairs, take, take_layer_norm, typed_layers,
                                         uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    cohere2 = config.model_type == "cohere2"
    qk_norm = not cohere2 and bool(getattr(config, "use_qk_norm", False))
    biases = attention_biases(config)

    def halves(t: torch.Tensor) -> torch.Tensor:
        return rotate_halves_not_pairs(t, d.head_dim, d.head_dim)

    def head_norm(w, name: str, heads: int) -> torch.Tensor:
        weight = halves(take(w, name, (heads, d.head_dim)).reshape(-1)).reshape(heads, d.head_dim)
        return torch.stack([weight, torch.zeros_like(weight)])

    def take_layer(w, i):
        p = f"model.layers.{i}."
        layer: RawLayer = llama_layer(w, i, d, config.intermediate_size, biases=biases, norms=False)
        layer.input_norm = take_layer_norm(w, f"{p}input_layernorm", (d.hidden,), False)
        layer.qkv, layer.qkv_bias = reorder_qk(layer.qkv, d, halves), reorder_qk(layer.qkv_bias, d, halves)
        if qk_norm:
            layer.q_norm = head_norm(w, f"{p}self_attn.q_norm.weight", d.num_heads)
            layer.k_norm = head_norm(w, f"{p}self_attn.k_norm.weight", d.num_kv_heads)
        return layer

    if cohere2:  # only the sliding layers rotate
        layers = [LayerAttention(sliding_window=a.sliding_window, rotary=a.sliding_window is not None) for a in typed_layers(config)]
    else:
        layers = uniform_layers(config, None)
    return DecoderSpec(take_layer=take_layer, layers=layers, norm="layer", norm_eps=config.layer_norm_eps, parallel_block=True,
                       parallel_attention_first=True,
                       qk_norm="head_layer" if qk_norm else None, logit_scale=float(config.logit_scale), qk_rows=halves)
