"""Rotary position embeddings, as a cos/sin table indexed by position (rotate-half convention).

``layer_type``: for configs whose ``rope_parameters`` hold one dict per layer type (Gemma 3:
"sliding_attention" / "full_attention"), the table of that type. A ``partial_rotary_factor``
below 1 gives a table narrower than the head, for the families that honour it (Phi-3): only the
first ``rotary_dim`` channels of each head rotate (:attr:`RotaryEmbedding.rotary_dim`)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

import kernels


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None, partial: bool = True) -> dict:
    """``partial=False``: the family rotates whole heads, ``partial_rotary_factor`` or not."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if "partial_rotary_factor" not in params:
        rotary_dim = getattr(config, "rotary_dim", None)  # GPT-J names the rotated width in channels
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        params["partial_rotary_factor"] = rotary_dim / head_dim if rotary_dim else getattr(config, "partial_rotary_factor", 1.0)
    if not partial:
        params["partial_rotary_factor"] = 1.0
    return params


def inverse_frequencies(config: PretrainedConfig, head_dim: int, layer_type: str | None = None,
                        partial: bool = True) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config, layer_type, partial)
    if params["rope_type"] != "default" and not partial and rope_parameters(config, layer_type)["partial_rotary_factor"] not in (None, 1, 1.0):
        # transformers' rope functions would build a table for part of each head, which these
        # families' attention then fails to apply (transformers cannot run such a config): no
        # reference to serve, so refuse rather than rotate part of each head
        raise ValueError(f"{config.model_type}: partial_rotary_factor with rope_type {params['rope_type']!r} is not supported "
                         "(this family rotates whole heads; transformers cannot run this config either)")
    dim = int(head_dim * (params["partial_rotary_factor"] or 1.0))
    if dim % 2 or dim <= 0:  # rotation pairs channels: transformers fails on such a table too
        raise ValueError(f"{config.model_type}: partial_rotary_factor {params['partial_rotary_factor']} gives {dim} rotary channels "
                         f"of a {head_dim}-channel head; rotary pairs need an even, positive number")
    if params["rope_type"] == "dynamic" and params.get("alpha") and config.model_type.startswith("hunyuan"):
        # Hunyuan's NTK-alpha: a static base theta * alpha ** (d / (d - 2)) (its rotary class
        # reads rope_type "dynamic" with an alpha so, never as dynamic NTK scaling)
        params = {**params, "rope_type": "default", "rope_theta": params["rope_theta"] * params["alpha"] ** (dim / (dim - 2))}
    if params["rope_type"] == "default":
        # float32 like the reference implementation, so greedy outputs match it bit for bit
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (params["rope_theta"] ** exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"), **kwargs)
    if config.model_type == "phimoe":  # Phi-3.5-MoE scales cos/sin by its own short_mscale, not the rope's factor
        scale = params["short_mscale"]
    return inv_freq.float(), scale


def exact_context(config: PretrainedConfig) -> int | None:
    """The longest sequence whose rotations a fixed table reproduces, where that is shorter than the
    model's context: under "longrope" transformers switches every position to the long factors
    once the sequence passes ``original_max_position_embeddings`` (re-rotating what is cached), so
    the short-factor table served here is exact only up to it. Phi-3.5-MoE switches its cos/sin
    scale from ``short_mscale`` to ``long_mscale`` there under every rope type but the default.
    None: no such limit."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    tables = [p for p in params.values() if isinstance(p, dict)] or [params]
    limits = []
    for p in tables:
        kind = p.get("rope_type", p.get("type"))
        if kind == "longrope" or config.model_type == "phimoe" and kind not in (None, "default"):
            original = p.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
            if original:
                limits.append(int(original))
    return min(limits) if limits else None


class RotaryEmbedding:
    """cos/sin tables by position, built for the first :data:`FIRST_ROWS` positions and grown (by
    doubling, up to ``max_positions``) when a step reaches past them (:meth:`reach`): a model
    with a 10M-token context (Llama 4 Scout) would otherwise spend 10 GB on tables at start-up.
    A position's row is the same whatever the table's length (elementwise products and cos/sin)."""

    FIRST_ROWS = 1 << 16

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int, device, dtype, backend: str = "cpu",
                 layer_type: str | None = None, partial: bool = True):
        self._inv_freq, self._scale = inverse_frequencies(config, head_dim, layer_type, partial)
        self._device, self._dtype = device, dtype
        self.rotary_dim = 2 * self._inv_freq.shape[0]
        self.max_positions = max_positions
        self._build(min(max_positions, self.FIRST_ROWS))
        # in place: the C kernel on CPU, the Triton kernel with the Triton backend
        self._apply = kernels.rotary_embedding_cpu_ if backend == "cpu" else kernels.rotary_embedding

    def _build(self, rows: int) -> None:
        freqs = torch.outer(torch.arange(rows, dtype=torch.float32), self._inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * self._scale).to(device=self._device, dtype=self._dtype)
        self.sin = (emb.sin() * self._scale).to(device=self._device, dtype=self._dtype)

    def covers(self, positions: int) -> bool:
        """Whether the tables hold positions ``[0, positions)`` (or all ``max_positions`` there are)."""
        rows = self.cos.shape[0]
        return positions <= rows or rows >= self.max_positions

    def reach(self, positions: int) -> None:
        """Tables covering positions ``[0, positions)`` (at most ``max_positions``), rebuilt where
        they did not (their tensors are then new: whoever bound the old ones must bind these)."""
        if not self.covers(positions):
            self._build(min(self.max_positions, max(positions, 2 * self.cos.shape[0])))

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotates q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` in place."""
        self._apply(positions, q, k, self.cos, self.sin)


class PartialRotaryEmbedding(RotaryEmbedding):
    """Rotates only each head's first ``rotary_dim`` channels (the rest pass through)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the C kernel rotates whole heads; the reference and the Triton kernel rotate views of the first channels
        if self._apply is kernels.rotary_embedding_cpu_:
            self._apply = kernels.rotary_embedding_ref

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        d = self.rotary_dim
        self._apply(positions, q[..., :d], k[..., :d], self.cos, self.sin)


def rotary_embedding(config: PretrainedConfig, head_dim: int, max_positions: int, device, dtype, backend: str = "cpu",
                     layer_type: str | None = None, partial: bool = True) -> RotaryEmbedding:
    """``partial``: the family honours ``partial_rotary_factor`` (see ``DecoderSpec.partial_rotary``)."""
    rope = RotaryEmbedding(config, head_dim, max_positions, device, dtype, backend, layer_type, partial)
    if rope.rotary_dim == head_dim:
        return rope
    return PartialRotaryEmbedding(config, head_dim, max_positions, device, dtype, backend, layer_type, partial)


class NoPETemperature:
    """Llama 4's NoPE layers: no rotation, but q scaled by position (attention temperature tuning):
    ``q * (log1p(floor((p + 1) / floor_scale)) * attn_scale + 1)`` at position ``p`` (1 below
    ``floor_scale - 1``). Called in the rope's place, with its signature; k is left as it is."""

    def __init__(self, floor_scale: float, attn_scale: float):
        self.floor_scale, self.attn_scale = float(floor_scale), float(attn_scale)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        q.copy_(q * scales.view(-1, 1, 1))  # an fp32 product, rounded once to q's dtype (as transformers)
