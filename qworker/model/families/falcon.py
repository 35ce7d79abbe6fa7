"""Falcon (``falcon``: Falcon-7B/40B/180B, Falcon2-11B, their fine-tunes). What differs from Llama:

* the checkpoint's own names (``transformer.word_embeddings``, ``transformer.h``,
  ``transformer.ln_f``), renamed as the weights are read (``checkpoint_name``);
* q/k/v fused in ``self_attention.query_key_value``, laid out three ways: by KV group (the "new
  decoder architecture" of 40B/180B: per group its query heads, then its k and its v),
  multi-query (every q head, then the one k and v: 7B), or per head (q, k, v of each head);
  regrouped at load into all q rows, then k, then v. The output projection is
  ``self_attention.dense``; biases on both and on the MLP where ``bias``;
* LayerNorm (``layer_norm_epsilon``) with biases; a non-gated MLP
  ``dense_4h_to_h(act(dense_h_to_4h(x)))`` (``activation``, GELU by default);
* ``parallel_attn`` (the default) or the new architecture: attention and MLP both read the
  layer's input and add to the residual together, the MLP through its own norm (``ln_mlp``)
  where the layer has two (``num_ln_in_parallel_attn`` 2, the new architecture's default), else
  through attention's; otherwise the layer is sequential (``post_attention_layernorm``).
ALiBi models (Falcon-RW) are refused. No window.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, RawLayer, activation, checkpoint_names, dims, per_head_to_grouped, take,
                                         take_layer_norm, take_plain_mlp, uniform_layers)

# the causal LM's names, and the language model's inside an image-text wrapper (after its own renaming)
_PREFIXES = (("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.h.", "model.layers."),
             ("transformer.ln_f.", "model.norm."), ("model.word_embeddings.", "model.embed_tokens."), ("model.h.", "model.layers."),
             ("model.ln_f.", "model.norm."))

checkpoint_name = checkpoint_names(_PREFIXES, ())


def build(config: PretrainedConfig) -> DecoderSpec:
    if getattr(config, "alibi", False):
        raise ValueError("falcon with alibi (Falcon-RW) is not supported: its attention adds position biases qworker's kernels do not have")
    d = dims(config)
    new_arch = bool(getattr(config, "new_decoder_architecture", False))
    parallel = new_arch or bool(getattr(config, "parallel_attn", True))
    two_norms = new_arch and (getattr(config, "num_ln_in_parallel_attn", None) or 2) == 2
    bias = bool(getattr(config, "bias", False))
    width = d.q_size + 2 * d.kv_size

    def grouped(t: torch.Tensor) -> torch.Tensor:
        if new_arch:  # [kv groups, (its q heads, k, v), head_dim, ...] -> q rows, k rows, v rows
            per_group = d.num_heads // d.num_kv_heads
            t = t.reshape(d.num_kv_heads, per_group + 2, d.head_dim, *t.shape[1:])
            return torch.cat([t[:, :per_group].reshape(d.q_size, *t.shape[3:]), t[:, per_group].reshape(d.kv_size, *t.shape[3:]),
                              t[:, per_group + 1].reshape(d.kv_size, *t.shape[3:])])
        if d.num_kv_heads == 1:  # multi-query: already q, then k, then v
            return t
        return per_head_to_grouped(t, d.num_heads, d.head_dim)

    def take_layer(w, i):
        p = f"model.layers.{i}."
        norm = lambda name: take_layer_norm(w, f"{p}{name}", (d.hidden,), True)  # noqa: E731
        return RawLayer(
            input_norm=norm("ln_attn" if two_norms else "input_layernorm"),
            mlp_norm=norm("ln_mlp") if two_norms else None if parallel else norm("post_attention_layernorm"),
            qkv=grouped(take(w, f"{p}self_attention.query_key_value.weight", (width, d.hidden))),
            qkv_bias=grouped(take(w, f"{p}self_attention.query_key_value.bias", (width,))) if bias else None,
            o=take(w, f"{p}self_attention.dense.weight", (d.hidden, d.q_size)),
            o_bias=take(w, f"{p}self_attention.dense.bias", (d.hidden,)) if bias else None,
            mlp=take_plain_mlp(w, f"{p}mlp.dense_h_to_4h", f"{p}mlp.dense_4h_to_h", d.hidden, config.ffn_hidden_size, bias),
        )

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), activation=activation(config, "activation"),
                       lora_modules=(), norm="layer", norm_eps=config.layer_norm_epsilon, parallel_block=parallel, final_norm_bias=True)
