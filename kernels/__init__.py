"""Paged-KV attention kernels (Triton) and their plain-torch references.

This package imports torch (and triton, lazily) only; never ``qworker``.

Every kernel ``f`` has a reference ``f_ref`` with the same signature in
:mod:`kernels.reference`; the engine runs the Triton versions on CUDA and the
references on CPU, except where the CPU has its own C kernels (:mod:`kernels.cpu`:
decode and prefill attention, the KV write, RMSNorm, rotary embedding, SwiGLU), which fall
back to the references where they cannot build. The layout they share (cache shape, what a slot is,
block tables, GQA head mapping) is documented in :mod:`kernels.reference`.

The Triton versions here are thin wrappers that import their module on first
call, for two reasons: ``import kernels`` works without triton installed (the
CPU engine needs only the references), and ``TRITON_INTERPRET`` is read when
a ``@triton.jit`` function is *defined*, so deferring the import lets a test
harness set it after ``kernels`` was imported.
"""

from __future__ import annotations

import importlib.util

import torch

from .cpu import (
    argmax_rows_cpu,
    cpu_kernels_available,
    paged_decode_attention_cpu,
    paged_prefill_attention_cpu,
    rms_norm_bf16_out_cpu,
    rms_norm_cpu,
    rotary_embedding_cpu_,
    silu_and_mul_cpu,
    store_kv_cpu,
)
from .reference import (
    paged_attention_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    rms_norm_ref,
    rotary_embedding_ref,
    silu_and_mul_ref,
    store_kv_ref,
)
from .moe_reference import moe_experts_ref, moe_align
from .lora_reference import LoraTiles, lora_expand_ref, lora_shrink_ref, lora_tiles

HAS_TRITON = importlib.util.find_spec("triton") is not None

__all__ = [
    "HAS_TRITON",
    "argmax_rows_cpu",
    "cpu_kernels_available",
    "paged_decode_attention_cpu",
    "paged_prefill_attention_cpu",
    "rms_norm_bf16_out_cpu",
    "rms_norm_cpu",
    "rotary_embedding_cpu_",
    "rotary_embedding_ref",
    "silu_and_mul_cpu",
    "silu_and_mul_ref",
    "store_kv_cpu",
    "store_kv",
    "store_kv_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "paged_attention",
    "paged_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_embedding",
    "silu_and_mul",
    "moe_experts",
    "moe_experts_ref",
    "moe_align",
    "lora_shrink",
    "lora_shrink_ref",
    "lora_expand",
    "lora_expand_ref",
    "lora_tiles",
    "LoraTiles",
]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``key``/``value`` ``[T, Hkv, D]`` into their slots; negative slot = skip. In place."""
    from .kv_store import store_kv as impl

    impl(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    **kwargs,
) -> torch.Tensor:
    """Flash-decoding over paged KV: ``q [B, Hq, D]`` -> ``[B, Hq, D]``. See :mod:`kernels.decode_attention`."""
    from .decode_attention import paged_decode_attention as impl

    return impl(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, **kwargs)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    **kwargs,
) -> torch.Tensor:
    """Varlen causal attention of new query chunks over paged KV. See :mod:`kernels.prefill_attention`."""
    from .prefill_attention import paged_prefill_attention as impl

    return impl(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len, **kwargs)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One step's attention: all ``q_len == 1`` (``max_query_len == 1``) goes to the
    decode kernel (``q`` rows are then the sequences), anything else to the
    prefill kernel, which handles decode rows of a mixed batch too.
    ``sliding_window``/``softcap``/``sinks``: see :mod:`kernels.reference`."""
    opts = dict(out=out, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    if max_query_len == 1:
        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, **opts)
    return paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len, **opts
    )


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``(x + residual)`` and RMSNorm: returns ``(out, new_residual)``."""
    from .rmsnorm import rms_norm as impl

    return impl(x, weight, eps, residual)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotary embedding in place on ``q [T, Hq, D]`` and ``k [T, Hk, D]``. See :mod:`kernels.rotary`."""
    from .rotary import rotary_embedding as impl

    impl(positions, q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused gate/up projection ``[..., 2I]`` -> ``[..., I]``. See :mod:`kernels.swiglu`."""
    from .swiglu import silu_and_mul as impl

    return impl(gate_up)


def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights_in_act_dtype: bool = False,
    **kwargs,
) -> torch.Tensor:
    """Mixture-of-experts grouped GEMM ``x [T, H]`` -> ``[T, H]``. See :mod:`kernels.fused_moe`."""
    from .fused_moe import moe_experts as impl

    return impl(x, gate_up, down, topk_weights, topk_ids, weights_in_act_dtype, **kwargs)


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    **kwargs,
) -> torch.Tensor:
    """Multi-LoRA shrink ``x [T, in]`` -> ``h [T, n*R]`` float32 over adapter segments. See :mod:`kernels.lora_sgmv`."""
    from .lora_sgmv import lora_shrink as impl

    return impl(x, a_stack, seg_start, seg_len, seg_slot, **kwargs)


def lora_expand(
    h: torch.Tensor,
    b_stack: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    seg_slot: torch.Tensor,
    y: torch.Tensor,
    out_offset: int,
    **kwargs,
) -> None:
    """Multi-LoRA expand, in place: ``y[rows, off:off+out] += h_rows @ B[slot].T``. See :mod:`kernels.lora_sgmv`."""
    from .lora_sgmv import lora_expand as impl

    impl(h, b_stack, seg_start, seg_len, seg_slot, y, out_offset, **kwargs)
