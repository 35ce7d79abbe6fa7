"""Phi-3.5-MoE (``phimoe``): Mixtral's layout with LayerNorm and SparseMixer routing.

* LayerNorm with biases for both norms of a layer and the final one (eps ``rms_norm_eps``);
  biases on q/k/v/o where ``attention_bias``; an LM-head bias where ``lm_head_bias``;
  ``sliding_window`` on every layer where set;
* a MoE in every layer, Mixtral's experts (``block_sparse_moe.experts.{e}.w1/w3/w2``, or
  transformers 5's ``mlp.experts.gate_up_proj``) under SparseMixer's top-2 routing as it runs at
  inference (:class:`qworker.model.moe.Routing` "sparsemixer": the best expert, then the best of
  the rest, each weighed by a softmax over the logits within ``2 * router_jitter_noise`` of its
  own maximum, relative to their magnitude);
* longrope: the short factors, cos/sin scaled by ``short_mscale`` (:mod:`qworker.model.rope`).
  Under every rope type but the default the scale switches to ``long_mscale`` past
  ``original_max_position_embeddings``, so the model is served up to there
  (:func:`qworker.model.rope.exact_context`).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.mixtral import take_block
from qworker.model.families.spec import (DecoderSpec, MoEWeights, RawLayer, attention_biases, dims, take, take_attention, take_layer_norm,
                                         uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    E = config.num_local_experts
    if config.num_experts_per_tok != 2:
        raise ValueError(f"phimoe: SparseMixer routing picks 2 experts a token, not num_experts_per_tok={config.num_experts_per_tok}")

    def take_moe(w, p):
        block, gate_up, down = take_block(w, p, E, d.hidden, config.intermediate_size)
        router = f"{block}router.weight" if block.endswith(".mlp.") else f"{block}gate.weight"  # transformers 5 renames it too
        return MoEWeights(take(w, router, (E, d.hidden)), gate_up, down, 2, renormalize=False, weights_in_act_dtype=True,
                          scoring="sparsemixer", jitter_eps=float(config.router_jitter_noise))

    def take_layer(w, i):
        p = f"model.layers.{i}."
        return RawLayer(input_norm=take_layer_norm(w, f"{p}input_layernorm", (d.hidden,), True),
                        mlp_norm=take_layer_norm(w, f"{p}post_attention_layernorm", (d.hidden,), True),
                        mlp=take_moe(w, p), **take_attention(w, p, d, attention_biases(config)))

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, getattr(config, "sliding_window", None)), norm="layer",
                       norm_eps=config.rms_norm_eps, final_norm_bias=True, head_bias=bool(getattr(config, "lm_head_bias", False)))
