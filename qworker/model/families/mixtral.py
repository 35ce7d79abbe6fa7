"""Mixtral: Mistral with a sparse MoE in every layer (``block_sparse_moe``: router ``gate``, experts'
``w1`` = gate, ``w3`` = up, ``w2`` = down). Router: softmax, top-k, always renormalised; the
routing weight multiplies each expert's output in fp32."""

from __future__ import annotations

from transformers import PretrainedConfig

import torch

from qworker.model.families.spec import (DecoderSpec, MoEWeights, Weights, attention_biases, dims, llama_layer, take, take_experts,
                                         uniform_layers)


def take_block(w: Weights, p: str, num_experts: int, hidden: int, intermediate: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Layer ``p``'s Mixtral-style experts: ``(the block's prefix, gate_up, down)``. transformers
    5's fused layout (see take_experts) names the block "mlp", as other families do; the original
    checkpoints ``block_sparse_moe`` with ``w1``/``w3``/``w2`` per expert."""
    block = f"{p}mlp." if f"{p}mlp.experts.gate_up_proj" in w else f"{p}block_sparse_moe."
    return (block, *take_experts(w, f"{block}experts.", num_experts, hidden, intermediate, names=("w1", "w3", "w2")))


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    E = config.num_local_experts

    def mlp(w, p):
        block, gate_up, down = take_block(w, p, E, d.hidden, config.intermediate_size)
        return MoEWeights(take(w, f"{block}gate.weight", (E, d.hidden)), gate_up, down, config.num_experts_per_tok,
                          renormalize=True, weights_in_act_dtype=False)

    return DecoderSpec(take_layer=lambda w, i: llama_layer(w, i, d, config.intermediate_size, mlp, biases=attention_biases(config)),
                       layers=uniform_layers(config, getattr(config, "sliding_window", None)))
