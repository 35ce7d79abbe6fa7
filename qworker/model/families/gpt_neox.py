"""GPT-NeoX (Pythia, GPT-NeoX-20B, and their fine-tunes). What differs from Llama:

* the checkpoint's own names (``gpt_neox.embed_in``, ``gpt_neox.layers``,
  ``gpt_neox.final_layer_norm``, ``embed_out``), renamed as the weights are read
  (:data:`CHECKPOINT_PREFIXES`);
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

from qworker.model.families.spec import DecoderSpec, DenseMLP, RawLayer, activation, dims, take, take_layer_norm, uniform_layers

CHECKPOINT_PREFIXES = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.layers.", "model.layers."),
                       ("gpt_neox.final_layer_norm.", "model.norm."), ("embed_out.", "lm_head."))


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    if d.num_kv_heads != d.num_heads:
        raise ValueError(f"gpt_neox: num_key_value_heads ({d.num_kv_heads}) differs from num_attention_heads ({d.num_heads}); "
                         "GPT-NeoX attention has a k and v for every head")
    inter = config.intermediate_size
    bias = bool(getattr(config, "attention_bias", True))
    parallel = bool(getattr(config, "use_parallel_residual", True))

    def per_head_to_grouped(t: torch.Tensor) -> torch.Tensor:
        """``[heads, (q, k, v), head_dim, ...]`` rows -> ``[(q, k, v), heads, head_dim, ...]``."""
        return t.reshape(d.num_heads, 3, d.head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    def take_layer(w, i):
        p = f"model.layers.{i}."
        qkv = take(w, f"{p}attention.query_key_value.weight", (3 * d.q_size, d.hidden))
        mlp = DenseMLP(take(w, f"{p}mlp.dense_h_to_4h.weight", (inter, d.hidden)), take(w, f"{p}mlp.dense_4h_to_h.weight", (d.hidden, inter)),
                       gated=False, up_bias=take(w, f"{p}mlp.dense_h_to_4h.bias", (inter,)),
                       down_bias=take(w, f"{p}mlp.dense_4h_to_h.bias", (d.hidden,)))
        return RawLayer(
            input_norm=take_layer_norm(w, f"{p}input_layernorm", (d.hidden,), True),
            mlp_norm=take_layer_norm(w, f"{p}post_attention_layernorm", (d.hidden,), True),
            qkv=per_head_to_grouped(qkv),
            qkv_bias=per_head_to_grouped(take(w, f"{p}attention.query_key_value.bias", (3 * d.q_size,))) if bias else None,
            o=take(w, f"{p}attention.dense.weight", (d.hidden, d.q_size)),
            o_bias=take(w, f"{p}attention.dense.bias", (d.hidden,)) if bias else None,
            mlp=mlp,
        )

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), activation=activation(config), gated_mlp=False,
                       norm="layer", norm_eps=config.layer_norm_eps, parallel_block=parallel, final_norm_bias=True, partial_rotary=True)
