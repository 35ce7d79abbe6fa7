"""Rotary position embeddings, as a cos/sin table indexed by position (rotate-half convention)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

import kernels


def rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        # float32 like the reference implementation, so greedy outputs match it bit for bit
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    return inv_freq.float(), scale


class RotaryEmbedding:
    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int, device, dtype, backend: str = "cpu"):
        inv_freq, scale = inverse_frequencies(config, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scale).to(device=device, dtype=dtype)

        # in place: the C kernel on CPU, the torch reference with the Triton backend (no Triton rope kernel)
        self._apply = kernels.rotary_embedding_cpu_ if backend == "cpu" else kernels.rotary_embedding_ref

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotates q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` in place."""
        self._apply(positions, q, k, self.cos, self.sin)
