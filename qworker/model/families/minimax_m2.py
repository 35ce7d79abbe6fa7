"""MiniMax-M2 (``minimax_m2``): Llama's layout with a MoE in every layer and OLMo 2's q/k norms.

* an RMSNorm over the full width of q and of k (before the head split and the rotation); rotary
  embeddings on each head's first ``rotary_dim`` (``partial_rotary_factor``) channels, in halves;
  no attention biases;
* the MoE: a sigmoid router, experts picked by the scores plus ``e_score_correction_bias`` and
  weighed by the scores alone, renormalised; no shared expert. Checkpoints as MiniMax stores them
  (Mixtral's ``block_sparse_moe`` with ``w1``/``w3``/``w2``) or as transformers 5 saves them."""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.mixtral import take_block
from qworker.model.families.spec import DecoderSpec, MoEWeights, attention_biases, dims, llama_layer, take, take_full_qk_norms, uniform_layers


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    E = config.num_local_experts

    def mlp(w, p):
        block, gate_up, down = take_block(w, p, E, d.hidden, config.intermediate_size)
        return MoEWeights(take(w, f"{block}gate.weight", (E, d.hidden)), gate_up, down, config.num_experts_per_tok, renormalize=True,
                          weights_in_act_dtype=False, scoring="sigmoid", choice_bias=take(w, f"{block}e_score_correction_bias", (E,)))

    def take_layer(w, i):
        return take_full_qk_norms(w, i, d, llama_layer(w, i, d, config.intermediate_size, mlp, biases=attention_biases(config)))

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), qk_norm="full", partial_rotary=True)
