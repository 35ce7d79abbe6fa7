"""GPT-2 (``gpt2``) and GPT-BigCode (``gpt_bigcode``: StarCoder 1, SantaCoder). What differs from Llama:

* learned absolute positions (``wpe``) added to the embeddings, and no rotary embeddings;
* the checkpoint's own names (``transformer.wte``/``wpe``/``h``/``ln_f``, or the same without
  ``transformer.`` as GPT-2's own exports have them), read as the causal-LM ones
  (:func:`checkpoint_name`); the causal-mask buffers older exports carry (``attn.bias``,
  ``attn.masked_bias``) are not weights and are not read;
* q/k/v fused (``attn.c_attn``), the output ``attn.c_proj``, a non-gated MLP
  ``mlp.c_proj(act(mlp.c_fc(x)))``, all with biases; GPT-2 stores them as ``[in, out]``
  (transposed at load); GPT-BigCode's fused q/k/v is laid out per head, or with
  ``multi_query`` all q rows then one k and one v head for all;
* LayerNorm with biases (``layer_norm_epsilon``); the LM head tied to the embedding.
  ``scale_attn_by_inverse_layer_idx`` and cross-attention are refused. No window.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, DenseMLP, LayerAttention, RawLayer, activation, dims, checkpoint_names,
                                         per_head_to_grouped, take, take_layer_norm)

_PREFIXES = tuple((f"{outer}{old}", new) for outer in ("transformer.", "") for old, new in
                  (("wte.", "model.embed_tokens."), ("wpe.", "model.embed_positions."), ("h.", "model.layers."), ("ln_f.", "model.norm.")))


checkpoint_name = checkpoint_names(_PREFIXES, (".attn.bias", ".attn.masked_bias"))


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    bigcode = config.model_type == "gpt_bigcode"
    inter = getattr(config, "n_inner", None) or 4 * d.hidden
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if getattr(config, flag, False):
            raise ValueError(f"{config.model_type}: {flag} is not supported")
    width = d.q_size + 2 * d.kv_size

    def linear(w, name: str, out_features: int, in_features: int) -> torch.Tensor:
        """An ``[out, in]`` weight: GPT-2's Conv1D stores ``[in, out]``."""
        if bigcode:
            return take(w, name, (out_features, in_features))
        return take(w, name, (in_features, out_features)).t()

    def take_layer(w, i):
        p = f"model.layers.{i}."
        qkv, qkv_bias = linear(w, f"{p}attn.c_attn.weight", width, d.hidden), take(w, f"{p}attn.c_attn.bias", (width,))
        if bigcode and not getattr(config, "multi_query", False):
            qkv, qkv_bias = per_head_to_grouped(qkv, d.num_heads, d.head_dim), per_head_to_grouped(qkv_bias, d.num_heads, d.head_dim)
        mlp = DenseMLP(linear(w, f"{p}mlp.c_fc.weight", inter, d.hidden), linear(w, f"{p}mlp.c_proj.weight", d.hidden, inter), gated=False,
                       up_bias=take(w, f"{p}mlp.c_fc.bias", (inter,)), down_bias=take(w, f"{p}mlp.c_proj.bias", (d.hidden,)))
        return RawLayer(input_norm=take_layer_norm(w, f"{p}ln_1", (d.hidden,), True), mlp_norm=take_layer_norm(w, f"{p}ln_2", (d.hidden,), True),
                        qkv=qkv, qkv_bias=qkv_bias, o=linear(w, f"{p}attn.c_proj.weight", d.hidden, d.q_size),
                        o_bias=take(w, f"{p}attn.c_proj.bias", (d.hidden,)), mlp=mlp)

    return DecoderSpec(take_layer=take_layer, layers=[LayerAttention(rotary=False) for _ in range(config.num_hidden_layers)],
                       activation=activation(config, "activation_function"), lora_modules=(), norm="layer",
                       norm_eps=config.layer_norm_epsilon, final_norm_bias=True, position_embeddings=True,
                       attn_scale=None if getattr(config, "scale_attn_weights", True) else 1.0)
