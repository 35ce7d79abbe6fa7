"""GLM (``glm``: GLM-4-9B-chat) and GLM-4 (``glm4``: the 0414 models). What differs from Llama:

* gate and up are stored fused (``mlp.gate_up_proj``, gate rows first), as in Phi-3;
* q/k/v biases where ``attention_bias`` says (True by default), never one on o;
* rotary embeddings on the first ``partial_rotary_factor`` (0.5) of each head, on interleaved
  channel pairs (2j, 2j+1). The kernels rotate halves (j, j + r/2), so each head's q and k rows
  are reordered at load (:func:`~qworker.model.families.spec.rotate_halves_not_pairs`), which
  changes no score: q and k get the same order, v and o keep theirs;
* GLM-4: four norms a layer (``post_self_attn_layernorm`` on the attention output before the
  residual add, ``post_attention_layernorm`` before the MLP, ``post_mlp_layernorm`` on its
  output), plain RMSNorm. Causal attention, no window (as transformers).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, DenseMLP, RawLayer, attention_biases, dims, reorder_qk, rotary_dim,
                                         rotate_halves_not_pairs, take, take_attention, uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    inter = config.intermediate_size
    biases = attention_biases(config)
    glm4 = config.model_type == "glm4"
    rot = rotary_dim(config)  # even: qworker.model.rope refuses an odd width

    def halves(t: torch.Tensor) -> torch.Tensor:
        return rotate_halves_not_pairs(t, d.head_dim, rot)

    def take_layer(w, i):
        p = f"model.layers.{i}."
        attn = take_attention(w, p, d, biases)
        attn["qkv"], attn["qkv_bias"] = reorder_qk(attn["qkv"], d, halves), reorder_qk(attn["qkv_bias"], d, halves)
        norm = lambda name: take(w, f"{p}{name}.weight", (d.hidden,))  # noqa: E731
        mlp = DenseMLP(take(w, f"{p}mlp.gate_up_proj.weight", (2 * inter, d.hidden)), take(w, f"{p}mlp.down_proj.weight", (d.hidden, inter)))
        layer = RawLayer(input_norm=norm("input_layernorm"), mlp_norm=norm("post_attention_layernorm"), mlp=mlp, **attn)
        if glm4:
            layer.attn_out_norm = norm("post_self_attn_layernorm")
            layer.mlp_out_norm = norm("post_mlp_layernorm")
        return layer

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), partial_rotary=True, qk_rows=halves,
                       lora_modules=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"))
