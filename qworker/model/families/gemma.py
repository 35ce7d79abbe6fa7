"""Gemma, Gemma 2 and Gemma 3 (text). What differs from Llama:

* RMSNorm scales by ``1 + w`` (folded into the weight at load); Gemma 2 and 3 have four norms a
  layer: input, on the attention output (before the residual add), before the MLP, on the MLP
  output (Gemma: Llama's two);
* embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model dtype;
* the MLP is GELU (tanh approximation) gated: ``down(gelu_tanh(gate(x)) * up(x))``;
* Gemma 2 and 3: attention scale ``query_pre_attn_scalar ** -0.5``, windows per layer from
  ``layer_types`` (Gemma: ``head_dim ** -0.5``, no window);
* Gemma 2: attention-score and final-logit soft-capping (``c * tanh(x / c)``); Gemma 3: the
  final-logit one only (its attention ignores ``attn_logit_softcapping``);
* VaultGemma: Gemma 2 without the norms on the attention and MLP outputs;
* Gemma 3: RMSNorm (1 + w) over each head of q and k; the sliding layers take their rope from
  ``rope_parameters["sliding_attention"]`` (``rope_local_base_freq``, 10k), the full ones from
  ``rope_parameters["full_attention"]``.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import (DecoderSpec, RawLayer, attention_biases, dims, ropes_by_layer_type, take, take_attention,
                                         take_dense_mlp, typed_layers, uniform_layers)

# transformers' names for GELU's tanh approximation (each computes 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))))
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    gemma1, gemma3 = config.model_type == "gemma", config.model_type == "gemma3_text"
    vault = config.model_type == "vaultgemma"  # Gemma 2 without the two output norms
    if getattr(config, "use_bidirectional_attention", False):
        # transformers attends both ways then (EmbeddingGemma): not a decoder this engine can serve
        raise ValueError(f"{config.model_type} with use_bidirectional_attention (an embedding model such as EmbeddingGemma) "
                         "attends to later tokens too; qworker serves causal decoders only")
    # Gemma's MLP reads hidden_act; Gemma 2 and 3 read hidden_activation
    act_name = (None if gemma1 else getattr(config, "hidden_activation", None)) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if act_name not in ACTIVATIONS:
        raise ValueError(f"{config.model_type}: unsupported hidden_activation {act_name!r}; supported: {sorted(ACTIVATIONS)}")

    def take_layer(w, i):
        p = f"model.layers.{i}."
        attn = take_attention(w, p, d, attention_biases(config))
        layer_norm = lambda name: take(w, f"{p}{name}.weight", (d.hidden,))  # noqa: E731
        if gemma1:
            return RawLayer(input_norm=layer_norm("input_layernorm"), mlp_norm=layer_norm("post_attention_layernorm"),
                            mlp=take_dense_mlp(w, f"{p}mlp.", d.hidden, config.intermediate_size), **attn)
        if vault:
            return RawLayer(input_norm=layer_norm("input_layernorm"), mlp_norm=layer_norm("pre_feedforward_layernorm"),
                            mlp=take_dense_mlp(w, f"{p}mlp.", d.hidden, config.intermediate_size), **attn)
        layer = RawLayer(
            input_norm=layer_norm("input_layernorm"),
            attn_out_norm=layer_norm("post_attention_layernorm"),
            mlp_norm=layer_norm("pre_feedforward_layernorm"),
            mlp_out_norm=layer_norm("post_feedforward_layernorm"),
            mlp=take_dense_mlp(w, f"{p}mlp.", d.hidden, config.intermediate_size),
            **attn,
        )
        if gemma3:
            layer.q_norm = take(w, f"{p}self_attn.q_norm.weight", (d.head_dim,))
            layer.k_norm = take(w, f"{p}self_attn.k_norm.weight", (d.head_dim,))
        return layer

    if gemma1:  # transformers' Gemma masks causally only
        rope_tables, layers = {None: None}, uniform_layers(config, None)
    elif gemma3:
        rope_tables, layers = ropes_by_layer_type(config, typed_layers(config))
    else:
        rope_tables, layers = {None: None}, typed_layers(config)
    return DecoderSpec(
        take_layer=take_layer,
        layers=layers,
        norm_plus_one=True,
        qk_norm="head" if gemma3 else None,
        activation=ACTIVATIONS[act_name],
        embed_scale=d.hidden**0.5,
        attn_scale=None if gemma1 else config.query_pre_attn_scalar**-0.5,
        # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it
        attn_softcap=None if gemma1 or gemma3 else getattr(config, "attn_logit_softcapping", None),
        final_softcap=None if gemma1 else getattr(config, "final_logit_softcapping", None),
        rope_tables=rope_tables,
    )
