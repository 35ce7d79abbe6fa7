"""Helium (Kyutai), ERNIE 4.5 and ERNIE 4.5 MoE (Baidu): Llama's layer with rotary embeddings on
interleaved channel pairs (2j, 2j+1) over the whole head, as GLM rotates part of it. The kernels
rotate halves (j, j + D/2), so each head's q and k rows are reordered at load
(:func:`~qworker.model.families.spec.rotate_halves_not_pairs`; q.k is unchanged).

* Helium: q/k/v biases where ``attention_bias`` says, none on o; MLP biases where ``mlp_bias``.
* ERNIE 4.5: biases on all four attention projections and the MLP where ``use_bias``.
* ERNIE 4.5 MoE: the layers ``moe_layer_start_index`` .. ``moe_layer_end_index`` whose index + 1
  is a multiple of ``moe_layer_interval`` hold a MoE (the rest a dense MLP of
  ``intermediate_size``): a softmax router over ``moe_num_experts``, experts picked by the
  probabilities plus ``e_score_correction_bias`` and weighed by the probabilities alone,
  renormalised (divided by their sum, at least ``moe_norm_min``); ``moe_num_shared_experts``
  shared experts as one MLP that every token takes; an LM-head bias where ``use_bias``. The
  router is kept in fp32 (as transformers keeps it).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, MoEWeights, attention_biases, dims, llama_layer, mlp_bias, reorder_qk,
                                         rotate_halves_not_pairs, take, take_dense_mlp, take_experts, uniform_layers)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    ernie = config.model_type.startswith("ernie")
    moe = config.model_type == "ernie4_5_moe"
    use_bias = bool(getattr(config, "use_bias", False)) if ernie else False
    biases = (use_bias, use_bias) if ernie else attention_biases(config)
    with_mlp_bias = use_bias if ernie else mlp_bias(config)

    def halves(t):
        return rotate_halves_not_pairs(t, d.head_dim, d.head_dim)

    def take_layer(w, i):
        mlp = routed_moe if moe and ernie_sparse_layer(config, i) else None
        layer = llama_layer(w, i, d, config.intermediate_size, mlp, biases=biases, mlp_bias=with_mlp_bias)
        layer.qkv, layer.qkv_bias = reorder_qk(layer.qkv, d, halves), reorder_qk(layer.qkv_bias, d, halves)
        return layer

    def routed_moe(w, p):
        E, inter = config.moe_num_experts, config.moe_intermediate_size
        gate_up, down = take_experts(w, f"{p}mlp.experts.", E, d.hidden, inter)
        block = MoEWeights(take(w, f"{p}mlp.gate.weight", (E, d.hidden)), gate_up, down, config.moe_k, renormalize=True,
                           weights_in_act_dtype=True, choice_bias=ernie_choice_bias(w, p, E),
                           renormalize_floor=float(getattr(config, "moe_norm_min", 0.0) or 0.0))
        if config.moe_num_shared_experts:
            block.shared = take_dense_mlp(w, f"{p}mlp.shared_experts.", d.hidden, inter * config.moe_num_shared_experts, use_bias)
        return block

    return DecoderSpec(take_layer=take_layer, layers=uniform_layers(config, None), qk_rows=halves, head_bias=moe and use_bias)


def ernie_sparse_layer(config: PretrainedConfig, i: int) -> bool:
    """Whether ERNIE 4.5 MoE's layer ``i`` holds the MoE (transformers' rule)."""
    end = config.moe_layer_end_index if config.moe_layer_end_index >= 0 else config.num_hidden_layers - 1
    return (i + 1) % config.moe_layer_interval == 0 and config.moe_layer_start_index <= i <= end


def ernie_choice_bias(w, p: str, num_experts: int):
    """``e_score_correction_bias`` (``[1, E]``) where transformers saves it (under the router), or
    where Baidu's checkpoints keep it (``mlp.moe_statics``), as ``[E]``."""
    name = f"{p}mlp.gate.moe_statics.e_score_correction_bias"
    if name not in w:
        name = f"{p}mlp.moe_statics.e_score_correction_bias"
    return take(w, name, (1, num_experts)).reshape(num_experts)


def checkpoint_name(name: str) -> str | None:
    """ERNIE 4.5 checkpoints may carry multi-token-prediction tensors (``mtp_*``), which
    transformers does not read: neither does the engine."""
    return None if name.startswith(("mtp", "model.mtp")) else name
