"""Granite (IBM): Llama with four scalars from its config: embeddings times
``embedding_multiplier``, attention scale ``attention_multiplier`` (instead of
``head_dim ** -0.5``), each branch's output times ``residual_multiplier`` before the residual add,
and logits divided by ``logits_scaling``. Causal attention only, as transformers' Granite."""

from __future__ import annotations

import math

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, attention_biases, dims, llama_layer, uniform_layers


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
    return DecoderSpec(
        take_layer=lambda w, i: llama_layer(w, i, d, config.intermediate_size, biases=biases),
        layers=uniform_layers(config, None),
        embed_scale=scalars["embedding_multiplier"],
        attn_scale=scalars["attention_multiplier"],
        residual_scale=scalars["residual_multiplier"],
        logit_divisor=scalars["logits_scaling"],
    )
