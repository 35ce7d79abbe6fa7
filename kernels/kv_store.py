"""Triton KV write: scatter a step's new keys/values into their cache slots.

(The module is not called ``store_kv.py`` because ``kernels.store_kv`` is the
exported function; a submodule of that name would replace it on import.)

One program per token: it copies the token's ``Hkv * D`` key and value
elements to ``slot = block_id * block_size + offset``. A negative slot
(padding) writes nothing. Importing this module needs triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contracts import check_vector, require


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HD_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, HD_PAD)
        h = offs // D
        d = offs % D
        mask = offs < HKV * D
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        dst = block * stride_cb + off * stride_cs + h * stride_ch + d
        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of :func:`kernels.reference.store_kv_ref` (same contract).

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV output)
    as long as their last dim is contiguous; caches must share one layout.
    """
    T, Hkv, D = key.shape
    require(value.shape == key.shape, f"value has shape {tuple(value.shape)}, key {tuple(key.shape)}")
    check_vector(slot_mapping, "slot_mapping", T)
    if T == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k_cache.shape[2:] == (Hkv, D), f"cache heads/dim {tuple(k_cache.shape[2:])} != {(Hkv, D)}"
    _store_kv_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HKV=Hkv, D=D, HD_PAD=triton.next_power_of_2(Hkv * D),
    )
