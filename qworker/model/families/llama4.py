"""Llama 4 (``llama4_text``: the language model of Llama 4 Scout and Maverick, whose image-text
checkpoints ``llama4`` serve it: :mod:`qworker.model.wrappers`). What differs from Llama:

* rotary embeddings on interleaved channel pairs (each head's q/k rows reordered at load, as for
  GLM), on the layers ``no_rope_layers`` marks 1; the others (every fourth) are NoPE layers whose
  q is scaled by position where ``attn_temperature_tuning`` (:class:`~qworker.model.rope.NoPETemperature`);
* ``use_qk_norm``: q and k of the rotary layers divided by their RMS over each head, without a
  weight (transformers applies it after rope; a rotation keeps each pair's norm, so before it is
  the same);
* the layers ``layer_types`` marks "chunked_attention" (the rotary ones) attend in chunks of
  ``attention_chunk_size`` (8192) tokens: a query at ``p`` sees keys from
  ``floor(p / chunk) * chunk`` on (:func:`qworker.model.attention.chunked_metadata`);
* the layers ``moe_layers`` lists (from ``interleave_moe_layer_step``) are a MoE
  (``feed_forward.router``, ``feed_forward.experts.gate_up_proj`` ``[E, H, 2I]`` and
  ``down_proj`` ``[E, I, H]``, transposed at load) with a shared expert every token takes: the
  top-k experts by router logit, each reading ``x * sigmoid(logit)`` (its input weighed, not its
  output); the others a dense MLP of ``intermediate_size_mlp`` (``feed_forward.*_proj``).

LoRA on q/k/v/o only (PEFT names the MLPs ``feed_forward``, which the adapter reader does not map).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from qworker.model.families.spec import (ATTENTION_LORA, DecoderSpec, LayerAttention, MoEWeights, RawLayer, attention_biases, dims,
                                         layer_types, reorder_qk, rotate_halves_not_pairs, take, take_attention, take_dense_mlp)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    n = config.num_hidden_layers
    rotary = list(config.no_rope_layers)
    moe_layers = set(config.moe_layers)
    if len(rotary) != n:
        raise ValueError(f"llama4_text: config.no_rope_layers has {len(rotary)} entries for {n} layers")
    E, inter = config.num_local_experts, config.intermediate_size
    biases = attention_biases(config)
    qk_norm = bool(config.use_qk_norm)

    def halves(t: torch.Tensor) -> torch.Tensor:
        return rotate_halves_not_pairs(t, d.head_dim, d.head_dim)

    def mlp(w, p, i):
        p = f"{p}feed_forward."
        if i not in moe_layers:
            return take_dense_mlp(w, p, d.hidden, config.intermediate_size_mlp)
        gate_up = take(w, f"{p}experts.gate_up_proj", (E, d.hidden, 2 * inter)).transpose(1, 2).contiguous()
        down = take(w, f"{p}experts.down_proj", (E, inter, d.hidden)).transpose(1, 2).contiguous()
        moe = MoEWeights(take(w, f"{p}router.weight", (E, d.hidden)), gate_up, down, config.num_experts_per_tok, renormalize=False,
                         weights_in_act_dtype=True, scoring="sigmoid", scale_inputs=True)
        moe.shared = take_dense_mlp(w, f"{p}shared_expert.", d.hidden, inter)
        return moe

    def take_layer(w, i):
        p = f"model.layers.{i}."
        attn = take_attention(w, p, d, biases)
        attn["qkv"], attn["qkv_bias"] = reorder_qk(attn["qkv"], d, halves), reorder_qk(attn["qkv_bias"], d, halves)
        layer = RawLayer(input_norm=take(w, f"{p}input_layernorm.weight", (d.hidden,)),
                         mlp_norm=take(w, f"{p}post_attention_layernorm.weight", (d.hidden,)), mlp=mlp(w, p, i), **attn)
        if qk_norm and rotary[i]:  # an RMSNorm without a weight: ones
            layer.q_norm = layer.k_norm = torch.ones(d.head_dim)
        return layer

    types = layer_types(config, ("full_attention", "chunked_attention"))
    chunk = config.attention_chunk_size
    if "chunked_attention" in types and not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk > 0):
        raise ValueError(f"llama4_text: config.layer_types marks layer {types.index('chunked_attention')} chunked, "
                         f"but attention_chunk_size is {chunk!r} (a positive number of tokens)")
    layers = [LayerAttention(rotary=bool(r), chunk=chunk if t == "chunked_attention" else None) for r, t in zip(rotary, types)]
    temperature = (config.floor_scale, config.attn_scale) if config.attn_temperature_tuning else None
    return DecoderSpec(take_layer=take_layer, layers=layers, qk_norm="head" if qk_norm else None,
                       nope_temperature=temperature, qk_rows=halves, lora_modules=ATTENTION_LORA)
