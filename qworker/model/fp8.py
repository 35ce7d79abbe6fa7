"""FP8 checkpoints, dequantized as they are loaded, so the engine serves them in the model dtype
(as transformers does with ``dequantize=True``; there is no FP8 GEMM here). Two formats:

* fine-grained FP8 (``quantization_config`` ``{"quant_method": "fp8", "weight_block_size": [128,
  128]}``: DeepSeek-V3/R1's released weights, Qwen3's ``-FP8`` models): ``X.weight``
  (``float8_e4m3fn``, ``[..., out, in]``) and ``X.weight_scale_inv`` (fp32, one scale per
  ``block_out x block_in`` block, ``[..., ceil(out / block_out), ceil(in / block_in)]``: the last
  blocks may be partial, as DeepSeek-V3's 576-row ``kv_a_proj_with_mqa``; one scale without
  ``weight_block_size``);
* compressed-tensors' ``float-quantized`` FP8 (``quant_method`` ``compressed-tensors``: the
  ``-FP8`` / ``-FP8-dynamic`` exports of llm-compressor): ``X.weight`` (``float8_e4m3fn``) and
  ``X.weight_scale``, one per tensor (``[1]``), per output channel (``[out, 1]``) or per block
  (``block_structure``), with dynamic activation scales (static ones are refused).

The weight is ``weight * scale`` (the scale broadcast over its block, row or tensor), in fp32,
rounded once to the model dtype, as transformers dequantizes. Embeddings, norms, routers and the
LM head are stored unquantized and read as they are."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)


@dataclass(frozen=True)
class Scheme:
    """How one checkpoint's FP8 weights are scaled: the scale tensor's name suffix (after
    ``.weight``) and its block (None: one scale per tensor or per output row, as its shape says)."""

    suffix: str
    block: tuple[int, int] | None


def scheme(quant: dict, where: str) -> Scheme | None:
    """The FP8 scheme of a ``quantization_config`` (None: not an FP8 method), or a one-line refusal
    of FP8 settings the dequantization does not cover."""
    method = quant.get("quant_method")
    if method == "fp8":
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"{where}: FP8 with activation_scheme {quant.get('activation_scheme')!r} is not supported (only 'dynamic')")
        if quant.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"{where}: FP8 format {quant.get('fmt')!r} is not supported (only 'e4m3')")
        block = quant.get("weight_block_size")
        return Scheme("_scale_inv", None if block is None else _block(block, "weight_block_size", where))
    if method == "compressed-tensors" and quant.get("format") == "float-quantized":
        return _compressed_tensors(quant, where)
    return None


def _block(block, field: str, where: str) -> tuple[int, int]:
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                                                          for b in block)):
        raise ValueError(f"{where}: {field} must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def _compressed_tensors(quant: dict, where: str) -> Scheme:
    """compressed-tensors' FP8 weights: every config group 8-bit float weights (per tensor,
    channel or block, one block shape for all), dynamic or no activation quantization, no KV cache
    scheme."""
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}: compressed-tensors quantization_config has no config_groups")
    if quant.get("kv_cache_scheme"):
        raise ValueError(f"{where}: compressed-tensors kv_cache_scheme is not supported")
    blocks = set()
    for name, group in groups.items():
        w, a = (group or {}).get("weights") or {}, (group or {}).get("input_activations")
        if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("tensor", "channel", "block"):
            raise ValueError(f"{where}: compressed-tensors group {name!r}: only 8-bit float weights per tensor, channel or block "
                             f"are supported, got {w.get('num_bits')}-bit {w.get('type')} by {w.get('strategy')}")
        if a and not a.get("dynamic"):
            raise ValueError(f"{where}: compressed-tensors group {name!r}: static activation scales are not supported (only dynamic)")
        blocks.add(_block(w.get("block_structure"), "block_structure", where) if w["strategy"] == "block" else None)
    if len(blocks) > 1:
        raise ValueError(f"{where}: compressed-tensors groups with different weight scale layouts are not supported")
    return Scheme("_scale", blocks.pop())


def dequantize(weight: torch.Tensor, scale: torch.Tensor, s: Scheme, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``weight`` (FP8 ``[..., out, in]``) times its ``scale`` (fp32), rounded to ``dtype``."""
    scale_name = name + s.suffix
    if weight.dtype not in FP8_DTYPES:
        raise ValueError(f"tensor {name!r} has a scale ({scale_name}) but is stored as {weight.dtype}, not float8_e4m3fn")
    if weight.dim() < 2:
        raise ValueError(f"tensor {name!r} is FP8 with shape {list(weight.shape)}; FP8 weights are matrices")
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"tensor {scale_name!r} holds NaN or infinite scales")
    rows, cols = weight.shape[-2:]
    if s.block is not None:
        expected = (*weight.shape[:-2], math.ceil(rows / s.block[0]), math.ceil(cols / s.block[1]))
        if tuple(scale.shape) != expected:
            raise ValueError(f"tensor {scale_name!r} has shape {list(scale.shape)}, expected {list(expected)} "
                             f"(blocks of {s.block[0]}x{s.block[1]} over {list(weight.shape)})")
        # a block larger than the weight is the whole weight: expand by at most its size
        b0, b1 = min(s.block[0], rows), min(s.block[1], cols)
        scale = scale.float().repeat_interleave(b0, dim=-2)[..., :rows, :].repeat_interleave(b1, dim=-1)[..., :cols]
    elif scale.numel() == 1:
        scale = scale.float().reshape(())
    elif tuple(scale.shape) == (*weight.shape[:-1], 1):  # one per output row
        scale = scale.float()
    else:
        raise ValueError(f"tensor {scale_name!r} has shape {list(scale.shape)}; expected one scale for {list(weight.shape)} "
                         f"or one per row ({[*weight.shape[:-1], 1]})")
    return (weight.float() * scale).to(dtype)


def dequantize_weights(weights: dict[str, torch.Tensor], s: Scheme, dtype: torch.dtype) -> None:
    """Every ``X.weight`` with its scale beside it replaced, in place, by the dequantized weight;
    an FP8 tensor without a scale is refused by name, and so is a checkpoint with no FP8 weight
    at all (its config says FP8: the two disagree)."""
    scales = [n for n in weights if n.endswith("weight" + s.suffix)]
    if not scales:
        raise ValueError(f"config.json's quantization_config says FP8, but the checkpoint holds no FP8 weight scales (*.weight{s.suffix})")
    for name in scales:
        base = name[:-len(s.suffix)]
        if base not in weights:
            raise ValueError(f"checkpoint has scale {name!r} without its weight {base!r}")
        weights[base] = dequantize(weights[base], weights.pop(name), s, dtype, base)
    unscaled = sorted(n for n, t in weights.items() if t.dtype in FP8_DTYPES)
    if unscaled:
        raise ValueError(f"tensor {unscaled[0]!r} is stored as FP8 without its scale ({unscaled[0]}{s.suffix})")
