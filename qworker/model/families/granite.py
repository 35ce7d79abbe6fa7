"""Granite (IBM): Llama with four scalars from its config: embeddings times
``embedding_multiplier``, attention scale ``attention_multiplier`` (instead of
``head_dim ** -0.5``), each branch's output times ``residual_multiplier`` before the residual add,
and logits divided by ``logits_scaling``. Causal attention only, as transformers' Granite.

GraniteMoE (``granitemoe``) and GraniteMoE-Shared (``granitemoeshared``): the same with a sparse
MoE in every layer (``block_sparse_moe``: router ``router.layer``, experts' gate and up fused as
``input_linear`` ``[E, 2I, H]``, down as ``output_linear``; top-k of the router logits, softmax
over those k, i.e. renormalised); Shared adds a dense expert every token takes, ungated
(``shared_mlp.input_linear`` / ``output_linear``, ``shared_intermediate_size``)."""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, DenseMLP, MoEWeights, attention_biases, dims, llama_layer, mlp_bias, take, uniform_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    biases = attention_biases(config)
    scalars = {name: float(getattr(config, name, 1.0)) for name in
               ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")}
    for name, value in scalars.items():  # a NaN or infinity would answer every job with token 0
        if not math.isfinite(value):
            raise ValueError(f"granite: {name} must be a finite number, got {value}")
    if scalars["logits_scaling"] <= 0:  # dividing by it would flip (or blow up) every logit's order
        raise ValueError(f"granite: logits_scaling must be positive, got {scalars['logits_scaling']}")
    inter = config.intermediate_size
    moe = config.model_type in ("granitemoe", "granitemoeshared")
    shared = (getattr(config, "shared_intermediate_size", 0) or 0) if config.model_type == "granitemoeshared" else 0

    def mlp(w, p):
        E = config.num_local_experts
        shared_p, p = p + "shared_mlp.", p + "block_sparse_moe."
        # transformers 5's own layout (save_original_format=False) names the same tensors otherwise
        v5 = f"{p}experts.gate_up_proj" in w
        router, gate_up, down = (("router.weight", "experts.gate_up_proj", "experts.down_proj") if v5 else
                                 ("router.layer.weight", "input_linear.weight", "output_linear.weight"))
        weights = MoEWeights(take(w, p + router, (E, d.hidden)), take(w, p + gate_up, (E, 2 * inter, d.hidden)),
                             take(w, p + down, (E, d.hidden, inter)), config.num_experts_per_tok, renormalize=True,
                             weights_in_act_dtype=True)
        if shared:
            weights.shared = DenseMLP(take(w, f"{shared_p}input_linear.weight", (2 * shared, d.hidden)),
                                      take(w, f"{shared_p}output_linear.weight", (d.hidden, shared)))
        return weights

    return DecoderSpec(
        take_layer=lambda w, i: llama_layer(w, i, d, inter, mlp if moe else None, biases=biases, mlp_bias=mlp_bias(config)),
        layers=uniform_layers(config, None),
        embed_scale=scalars["embedding_multiplier"],
        attn_scale=scalars["attention_multiplier"],
        residual_scale=scalars["residual_multiplier"],
        logit_divisor=scalars["logits_scaling"],
    )
