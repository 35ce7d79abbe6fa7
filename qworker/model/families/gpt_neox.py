"""GPT-NeoX (Pythia, GPT-NeoX-20B, and their fine-tunes). What differs from Llama:

* the checkpoint's own names (``gpt_neox.embed_in``, ``gpt_neox.layers``,
  ``gpt_neox.final_layer_norm``, ``embed_out``), renamed as the weights are read
  (``checkpoint_name``); the causal-mask buffers older exports carry are not read;
* q/k/v fused per head (``attention.query_key_value``: each head's q, k and v rows together),
  regrouped at load into all q rows, then k, then v; every head has its own k and v;
* LayerNorm with biases; the output projection is ``attention.dense``; biases on q/k/v and it
  where ``attention_bias``; a non-gated MLP ``dense_4h_to_h(act(dense_h_to_4h(x)))`` with biases;
* rotary on the first ``partial_rotary_factor`` (0.25) of each head;
* ``use_parallel_residual`` (the default): attention reads ``input_layernorm(x)``, the MLP
  ``post_attention_layernorm(x)``, both outputs added to ``x`` together. No window.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, RawLayer, activation, checkpoint_names, dims, per_head_to_grouped, take,
                                         take_layer_norm, take_plain_mlp, uniform_layers)

_PREFIXES = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.layers.", "model.layers."),
             ("gpt_neox.final_layer_norm.", "model.norm."), ("embed_out.", "lm_head."))


# older EleutherAI exports (Pythia, GPT-NeoX-20B) carry each layer's causal mask (helper-90)
checkpoint_name = checkpoint_names(_PREFIXES, (".attention.bias", ".attention.masked_bias"))


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)  # a k and v for every head
    inter = config.intermediate_size
    bias = bool(getattr(config, "attention_bias", True))
    parallel = bool(getattr(config, "use_parallel_residual", True))

    def grouped(t: torch.Tensor) -> torch.Tensor:
        return per_head_to_grouped(t, d.num_heads, d.head_dim)

    def take_layer(w, i):
        p = f"model.layers.{i}."
        qkv = take(w, f"{p}attention.query_key_value.weight", (3 * d.q_size, d.hidden))
        mlp = take_plain_mlp(w, f"{p}mlp.dense_h_to_4h", f"{p}mlp.dense_4h_to_h", d.hidden, inter, True)
        return RawLayer(
            input_norm=take_layer_norm(w, f"{p}input_layernorm", (d.hidden,), True),
            mlp_norm=take_layer_norm(w, f"{p}post_attention_layernorm", (d.hidden,), True),
            qkv=grouped(qkv),
            qkv_bias=grouped(take(w, f"{p}attention.query_key_value.bias", (3 * d.q_size,))) if bias else None,
            o=take(w, f"{p}attention.dense.weight", (d.hidden, d.q_size)),
            o_bias=take(w, f"{p}attention.dense.bias", (d.hidden,)) if bias else None,
            mlp=mlp,
        )

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), activation=activation(config), lora_modules=(),
                       norm="layer", norm_eps=config.layer_norm_eps, parallel_block=parallel, final_norm_bias=True, partial_rotary=True)
