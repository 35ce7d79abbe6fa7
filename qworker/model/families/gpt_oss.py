"""gpt-oss (OpenAI's gpt-oss-20b and -120b). What differs from Llama:

* attention sinks: each layer's ``self_attn.sinks`` gives every query head one more logit in its
  softmax, with no value (:mod:`kernels.reference`); q/k/v/o biases (``attention_bias``);
* windows on the layers ``layer_types`` marks sliding (128 in the released models); YaRN rope;
* a sparse MoE in every layer: the router has a bias and takes the top-k of its logits, softmax
  over those k; the experts have biases and the clamped SwiGLU
  ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=l)``
  (``swiglu_alpha``, ``swiglu_limit``). The checkpoint stores each expert's gate and up
  interleaved (gate j in column 2j, up j in 2j + 1) as ``[E, H, 2I]`` and down as ``[E, I, H]``:
  transposed and de-interleaved at load;
* the released checkpoints hold the experts in MXFP4 (``*_blocks``: two 4-bit e2m1 values a byte,
  low nibble first, 32 to a block; ``*_scales``: a power-of-two exponent per block, biased by
  127): dequantized at load (:func:`dequantize_mxfp4`), so the engine serves them in the model
  dtype, as transformers does where it has no MXFP4 kernels.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from qworker.model.families.spec import (ATTENTION_LORA, DecoderSpec, MoEWeights, Weights, attention_biases, dims, llama_layer, take,
                                         typed_layers)

# e2m1: sign, two exponent bits, one mantissa bit
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` uint8 ``[E, ..., G, 16]`` and ``scales`` uint8 ``[E, ..., G]`` -> ``[E, ..., G * 32]``
    in ``dtype``, one expert at a time (the temporaries of a whole 120b tensor would be tens of GB)."""
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty((*blocks.shape[:-2], blocks.shape[-2] * 32), dtype=dtype, device=blocks.device)
    for e in range(blocks.shape[0]):
        b = blocks[e]
        values = torch.stack([table[(b & 0x0F).int()], table[(b >> 4).int()]], dim=-1).flatten(-2)  # low nibble first
        values = torch.ldexp(values, (scales[e].to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
        out[e] = values.flatten(-2)  # exact in fp32 and bf16: two mantissa bits times a power of two
    return out


def _take_packed(w: Weights, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    t = w.pop(name, None)
    if t is None:
        raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
    if t.dtype != torch.uint8 or tuple(t.shape) != shape:
        raise ValueError(f"tensor {name!r} is {t.dtype} {list(t.shape)}, expected uint8 {list(shape)} (MXFP4)")
    return t


def _expert_weights(w: Weights, p: str, name: str, E: int, out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """An expert projection as ``[E, out, in]``: the checkpoint's ``[E, in, out]`` transposed, or
    its MXFP4 ``{name}_blocks``/``_scales`` (stored ``[E, out, in / 32, ...]``) dequantized."""
    if f"{p}{name}_blocks" in w:
        if in_features % 32:
            raise ValueError(f"{p}{name}: MXFP4 needs input features in blocks of 32, got {in_features}")
        blocks = _take_packed(w, f"{p}{name}_blocks", (E, out_features, in_features // 32, 16))
        scales = _take_packed(w, f"{p}{name}_scales", (E, out_features, in_features // 32))
        return dequantize_mxfp4(blocks, scales, dtype)
    return take(w, f"{p}{name}", (E, in_features, out_features)).transpose(1, 2)


def _gate_rows_then_up(t: torch.Tensor) -> torch.Tensor:
    """Dim 1's interleaved gate/up (gate j at 2j, up j at 2j + 1) as gate rows, then up rows."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def build(config: PretrainedConfig) -> DecoderSpec:
    d = dims(config)
    E, inter = config.num_local_experts, config.intermediate_size
    swiglu = (float(getattr(config, "swiglu_alpha", 1.702)), float(getattr(config, "swiglu_limit", 7.0)))
    biases = attention_biases(config)

    def mlp(w, p):
        p += "mlp."
        router = take(w, f"{p}router.weight", (E, d.hidden))
        dtype = router.dtype  # the model's: MXFP4 experts are dequantized straight into it
        gate_up = _expert_weights(w, f"{p}experts.", "gate_up_proj", E, 2 * inter, d.hidden, dtype)
        down = _expert_weights(w, f"{p}experts.", "down_proj", E, d.hidden, inter, dtype)
        return MoEWeights(router, _gate_rows_then_up(gate_up).contiguous(), down.contiguous(),
                          config.num_experts_per_tok, renormalize=True, weights_in_act_dtype=True,
                          router_bias=take(w, f"{p}router.bias", (E,)),
                          gate_up_bias=_gate_rows_then_up(take(w, f"{p}experts.gate_up_proj_bias", (E, 2 * inter))),
                          down_bias=take(w, f"{p}experts.down_proj_bias", (E, d.hidden)), clamped_swiglu=swiglu)

    def take_layer(w, i):
        layer = llama_layer(w, i, d, inter, mlp, biases=biases)
        layer.sinks = take(w, f"model.layers.{i}.self_attn.sinks", (d.num_heads,))
        return layer

    return DecoderSpec(take_layer=take_layer, layers=typed_layers(config), lora_modules=ATTENTION_LORA)
