"""OPT (Meta's OPT-125m ... OPT-66b). What differs from Llama:

* learned absolute positions, looked up at position + 2 (``embed_positions`` holds
  ``max_position_embeddings + 2`` rows), added to the embeddings; no rotary embeddings;
* the checkpoint's own names (``model.decoder.*``, or ``decoder.*`` as OPTModel exports have
  them), read as the causal-LM ones (:func:`checkpoint_name`);
* LayerNorm (eps 1e-5; without weights where ``layer_norm_elementwise_affine`` is off) before
  attention (``self_attn_layer_norm``) and the MLP (``final_layer_norm``) and at the end;
  ``self_attn.out_proj`` for o; q/k/v/o and MLP biases where ``enable_bias``; a non-gated MLP
  ``fc2(relu(fc1(x)))``; the head tied to the embedding.

Refused in one line: ``do_layer_norm_before`` off (OPT-350m's norms after each branch),
``word_embed_proj_dim`` other than ``hidden_size`` (its projections in and out of the
embedding width) and a removed final norm (``_remove_final_layer_norm``).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, LayerAttention, RawLayer, activation, dims, no_affine_norm, renamed, take,
                                         take_layer_norm, take_plain_mlp)

EPS = 1e-5  # nn.LayerNorm's default: OPT's norms take no eps from the config
POSITION_OFFSET = 2
_PREFIXES = tuple((f"{outer}decoder.{old}", new) for outer in ("model.", "") for old, new in
                  (("embed_tokens.", "model.embed_tokens."), ("embed_positions.", "model.embed_positions."),
                   ("layers.", "model.layers."), ("final_layer_norm.", "model.norm.")))


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name as the family reads it."""
    return renamed(name, _PREFIXES)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    if not getattr(config, "do_layer_norm_before", True):
        raise ValueError("opt: do_layer_norm_before=False (norms after each branch, as in OPT-350m) is not supported")
    if getattr(config, "word_embed_proj_dim", d.hidden) != d.hidden:
        raise ValueError("opt: word_embed_proj_dim differs from hidden_size (projections in and out of the embedding width) "
                         "is not supported")
    if getattr(config, "_remove_final_layer_norm", False):
        raise ValueError("opt: _remove_final_layer_norm is not supported")
    inter = config.ffn_dim
    bias = bool(getattr(config, "enable_bias", True))
    affine = bool(getattr(config, "layer_norm_elementwise_affine", True))

    def norm(w, prefix: str) -> torch.Tensor:
        if affine:
            return take_layer_norm(w, prefix, (d.hidden,), True)
        return no_affine_norm(d.hidden)

    def take_layer(w, i):
        p = f"model.layers.{i}."
        qkv = [take(w, f"{p}self_attn.{n}_proj.weight", (d.q_size, d.hidden)) for n in "qkv"]
        mlp = take_plain_mlp(w, f"{p}fc1", f"{p}fc2", d.hidden, inter, bias)
        return RawLayer(input_norm=norm(w, f"{p}self_attn_layer_norm"), mlp_norm=norm(w, f"{p}final_layer_norm"), mlp=mlp,
                        qkv=torch.cat(qkv), o=take(w, f"{p}self_attn.out_proj.weight", (d.hidden, d.q_size)),
                        qkv_bias=torch.cat([take(w, f"{p}self_attn.{n}_proj.bias", (d.q_size,)) for n in "qkv"]) if bias else None,
                        o_bias=take(w, f"{p}self_attn.out_proj.bias", (d.hidden,)) if bias else None)

    return DecoderSpec(take_layer=take_layer, layers=[LayerAttention(rotary=False) for _ in range(config.num_hidden_layers)],
                       activation=activation(config, "activation_function"), lora_modules=(),  # PEFT's model.decoder.layers names are not mapped
                       norm="layer", norm_eps=EPS, final_norm="model.norm" if affine else None, final_norm_bias=True,
                       position_embeddings=True, position_offset=POSITION_OFFSET)
