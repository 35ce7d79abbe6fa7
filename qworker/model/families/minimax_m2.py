"""MiniMax-M2 (``minimax_m2``): Llama's layout with a MoE in every layer and OLMo 2's q/k norms.

* an RMSNorm over the full width of q and of k (before the head split and the rotation); rotary
  embeddings on each head's first ``rotary_dim`` (``partial_rotary_factor``) channels, in halves;
  no attention biases;
* the MoE: a sigmoid router, experts picked by the scores plus ``e_score_correction_bias`` and
  weighed by the scores alone, renormalised; no shared expert. Checkpoints as MiniMax stores them
  (Mixtral's ``block_sparse_moe`` with ``w1``/``w3``/``w2``) or as transformers 5 saves them."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import DecoderSpec, MoEWeights, attention_biases, dims, llama_layer, take, take_experts, uniform_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    E = config.num_local_experts

    def mlp(w, p):
        # transformers 5's fused layout (see take_experts) names the block "mlp", as Mixtral's does
        p += "mlp." if f"{p}mlp.experts.gate_up_proj" in w else "block_sparse_moe."
        gate_up, down = take_experts(w, f"{p}experts.", E, d.hidden, config.intermediate_size, names=("w1", "w3", "w2"))
        return MoEWeights(take(w, f"{p}gate.weight", (E, d.hidden)), gate_up, down, config.num_experts_per_tok, renormalize=True,
                          weights_in_act_dtype=False, scoring="sigmoid", choice_bias=take(w, f"{p}e_score_correction_bias", (E,)))

    def take_layer(w, i):
        layer = llama_layer(w, i, d, config.intermediate_size, mlp, biases=attention_biases(config))
        p = f"model.layers.{i}.self_attn."
        layer.q_norm = take(w, f"{p}q_norm.weight", (d.q_size,))
        layer.k_norm = take(w, f"{p}k_norm.weight", (d.kv_size,))
        return layer

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), qk_norm="full", partial_rotary=True)
