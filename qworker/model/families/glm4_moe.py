"""GLM-4.5 and GLM-4.6 (``glm4_moe``: GLM-4.5, GLM-4.5-Air, GLM-4.6) and dots.llm1 (``dots1``).
What differs from Llama:

* GLM: q/k/v biases where ``attention_bias`` says, none on o; per-head q/k RMSNorms where
  ``use_qk_norm``; rotary embeddings on each head's first ``partial_rotary_factor`` (0.5) of
  channels, in halves (no reordering, unlike GLM-4). dots1: Qwen3's attention (per-head q/k
  RMSNorms, biases on all four where ``attention_bias``, windows on the layers ``layer_types``
  marks sliding);
* the first ``first_k_dense_replace`` layers have a dense MLP, the rest DeepSeek-V3's MoE (sigmoid
  router with ``e_score_correction_bias``, expert groups, ``routed_scaling_factor``, shared
  experts: :func:`qworker.model.families.deepseek.routed_moe`);
* checkpoints carry a multi-token-prediction layer after the last one (not read:
  :mod:`qworker.model.loader`). GLM: causal attention, no window (as transformers).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.deepseek import routed_moe
from qworker.model.families.spec import DecoderSpec, attention_biases, dims, llama_layer, take, typed_layers, uniform_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    glm = config.model_type == "glm4_moe"
    qk_norm = bool(getattr(config, "use_qk_norm", False)) or not glm

    def take_layer(w, i):
        dense = i < config.first_k_dense_replace
        mlp = None if dense else lambda w, p: routed_moe(w, p, config, d.hidden, v3_router=True)
        layer = llama_layer(w, i, d, config.intermediate_size, mlp, biases=attention_biases(config))
        if qk_norm:
            p = f"model.layers.{i}.self_attn."
            layer.q_norm = take(w, f"{p}q_norm.weight", (d.head_dim,))
            layer.k_norm = take(w, f"{p}k_norm.weight", (d.head_dim,))
        return layer

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None) if glm else typed_layers(config), partial_rotary=glm,
                       qk_norm="head" if qk_norm else None)
