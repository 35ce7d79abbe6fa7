"""GPT-J. What differs from Llama:

* the checkpoint's own names (``transformer.wte``/``h``/``ln_f``; the causal-mask buffers older
  exports carry are not read), read as the causal-LM ones (:func:`checkpoint_name`);
* one LayerNorm (with bias) a layer, read by attention and the MLP alike, whose outputs join the
  residual together (a parallel block); ``attn.out_proj`` for o; no attention biases;
* rotary on the first ``rotary_dim`` channels of each head, on interleaved pairs (2j, 2j+1):
  each head's q and k rows are reordered at load as for GLM
  (:func:`~qworker.model.families.spec.rotate_halves_not_pairs`);
* a non-gated MLP ``fc_out(act(fc_in(x)))`` with biases; an LM head with a bias. No window.

LoRA is not served for GPT-J: PEFT names its layers ``transformer.h.N.attn``, which the adapter
reader does not map (an adapter is refused by name).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, RawLayer, activation, checkpoint_names, dims, rotary_dim, rotate_halves_not_pairs,
                                         take, take_layer_norm, take_plain_mlp, uniform_layers)

_PREFIXES = (("transformer.wte.", "model.embed_tokens."), ("transformer.h.", "model.layers."), ("transformer.ln_f.", "model.norm."))


checkpoint_name = checkpoint_names(_PREFIXES, (".attn.bias", ".attn.masked_bias"))


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    inter = getattr(config, "n_inner", None) or 4 * d.hidden
    rot = rotary_dim(config)

    def halves(t: torch.Tensor) -> torch.Tensor:
        return rotate_halves_not_pairs(t, d.head_dim, rot)

    def take_layer(w, i):
        p = f"model.layers.{i}."
        q, k, v = (take(w, f"{p}attn.{n}_proj.weight", (d.q_size, d.hidden)) for n in "qkv")
        mlp = take_plain_mlp(w, f"{p}mlp.fc_in", f"{p}mlp.fc_out", d.hidden, inter, True)
        return RawLayer(input_norm=take_layer_norm(w, f"{p}ln_1", (d.hidden,), True), mlp_norm=None, mlp=mlp,
                        qkv=torch.cat([halves(q), halves(k), v]), qkv_bias=None,
                        o=take(w, f"{p}attn.out_proj.weight", (d.hidden, d.q_size)), o_bias=None)

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), activation=activation(config, "activation_function"),
                       lora_modules=(), norm="layer", norm_eps=config.layer_norm_epsilon, parallel_block=True,
                       final_norm_bias=True, head_bias=True, partial_rotary=True, qk_rows=halves)
