"""Hunyuan (Tencent: ``hunyuan_v1_dense``, ``hunyuan_v1_moe``): Llama's layer with an RMSNorm over
each head of q and k **after** the rotation (``query_layernorm``, ``key_layernorm``; Qwen3 norms
before it), biases on the four attention projections where ``attention_bias``, none on the MLP.
Rope: the ``rope_parameters`` as usual, where rope_type "dynamic" with an ``alpha`` is Hunyuan's
static NTK-alpha base (:func:`qworker.model.rope.inverse_frequencies`).

The MoE model has a MoE in every layer: a softmax router (``mlp.gate.wg``, kept in fp32 as
transformers keeps it) over ``num_experts`` experts of ``intermediate_size``, the top
``moe_topk`` renormalised, plus a shared MLP of ``intermediate_size`` that every token takes
(``mlp.shared_mlp``). Per-layer lists of expert counts or top-k are read by layer."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, MoEWeights, attention_biases, dims, llama_layer, take, take_dense_mlp, take_experts,
                                         uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    biases = attention_biases(config)
    moe = config.model_type == "hunyuan_v1_moe"

    def routed_moe(w, p, i):
        E, top_k = _per_layer(config.num_experts, i), _per_layer(config.moe_topk, i)
        gate_up, down = take_experts(w, f"{p}mlp.experts.", E, d.hidden, config.intermediate_size)
        block = MoEWeights(take(w, f"{p}mlp.gate.wg.weight", (E, d.hidden)), gate_up, down, top_k, renormalize=True,
                           weights_in_act_dtype=False)
        block.shared = take_dense_mlp(w, f"{p}mlp.shared_mlp.", d.hidden, config.intermediate_size)
        return block

    def take_layer(w, i):
        mlp = (lambda w, p: routed_moe(w, p, i)) if moe else None
        layer = llama_layer(w, i, d, config.intermediate_size, mlp, biases=biases)
        p = f"model.layers.{i}.self_attn."
        layer.q_norm = take(w, f"{p}query_layernorm.weight", (d.head_dim,))
        layer.k_norm = take(w, f"{p}key_layernorm.weight", (d.head_dim,))
        return layer

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), qk_norm="head_after_rope")


def _per_layer(value, i: int) -> int:
    return int(value[i]) if isinstance(value, (list, tuple)) else int(value)
