"""Fine-grained FP8 checkpoints (``quantization_config`` ``{"quant_method": "fp8",
"weight_block_size": [128, 128]}``: DeepSeek-V3/R1's released weights, Qwen3's ``-FP8`` models),
dequantized as they are loaded, so the engine serves them in the model dtype (as transformers does
with ``dequantize=True``; there is no FP8 GEMM here).

Each quantized projection is stored as ``X.weight`` (``float8_e4m3fn``, ``[..., out, in]``) and
``X.weight_scale_inv`` (fp32, one scale per ``block_out x block_in`` block, ``[..., ceil(out /
block_out), ceil(in / block_in)]``: the last blocks may be partial, as DeepSeek-V3's 576-row
``kv_a_proj_with_mqa``; a single one without ``weight_block_size``); the weight is ``weight *
scale`` block by block, in fp32, rounded once to the model dtype (as transformers dequantizes).
Embeddings, norms, routers and the LM head are stored unquantized."""

from __future__ import annotations

import math

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn,)


def block_size(quant: dict, where: str) -> tuple[int, int] | None:
    """The ``weight_block_size`` of a fine-grained FP8 ``quantization_config`` (None: one scale per
    tensor), or a one-line refusal of settings the dequantization does not cover."""
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"{where}: FP8 with activation_scheme {quant.get('activation_scheme')!r} is not supported (only 'dynamic')")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}: FP8 format {quant.get('fmt')!r} is not supported (only 'e4m3')")
    block = quant.get("weight_block_size")
    if block is None:
        return None
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                                                          for b in block)):
        raise ValueError(f"{where}: weight_block_size must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype,
               name: str) -> torch.Tensor:
    """``weight`` (FP8 ``[..., out, in]``) times its per-block ``scale`` (fp32), rounded to ``dtype``."""
    if weight.dtype not in FP8_DTYPES:
        raise ValueError(f"tensor {name!r} has a scale ({name}{SCALE_SUFFIX}) but is stored as {weight.dtype}, not float8_e4m3fn")
    if weight.dim() < 2:
        raise ValueError(f"tensor {name!r} is FP8 with shape {list(weight.shape)}; FP8 weights are matrices")
    rows, cols = weight.shape[-2:]
    if block is None:
        if scale.numel() != 1:
            raise ValueError(f"tensor {name + SCALE_SUFFIX!r} has shape {list(scale.shape)}; without weight_block_size one scale is expected")
        return (weight.float() * scale.reshape(()).float()).to(dtype)
    expected = (*weight.shape[:-2], math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"tensor {name + SCALE_SUFFIX!r} has shape {list(scale.shape)}, expected {list(expected)} "
                         f"(blocks of {block[0]}x{block[1]} over {list(weight.shape)})")
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"tensor {name + SCALE_SUFFIX!r} holds NaN or infinite scales")
    s = scale.float().repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.float() * s).to(dtype)


def dequantize_weights(weights: dict[str, torch.Tensor], block: tuple[int, int] | None, dtype: torch.dtype) -> None:
    """Every ``X`` with an ``X_scale_inv`` beside it replaced, in place, by its dequantized weight;
    an FP8 tensor without a scale is refused by name, and so is a checkpoint with no FP8 weight
    at all (its config says FP8: the two disagree)."""
    scales = [n for n in weights if n.endswith(SCALE_SUFFIX)]
    if not scales:
        raise ValueError("config.json's quantization_config says fp8, but the checkpoint holds no FP8 weight scales "
                         f"(*.weight{SCALE_SUFFIX})")
    for name in scales:
        base = name[:-len(SCALE_SUFFIX)]
        if base not in weights:
            raise ValueError(f"checkpoint has scale {name!r} without its weight {base!r}")
        weights[base] = dequantize(weights[base], weights.pop(name), block, dtype, base)
    unscaled = sorted(n for n, t in weights.items() if t.dtype in FP8_DTYPES)
    if unscaled:
        raise ValueError(f"tensor {unscaled[0]!r} is stored as FP8 without its scale ({unscaled[0]}{SCALE_SUFFIX})")
