"""Triton KV write and fused RMSNorm against their references."""

from __future__ import annotations

import pytest
import torch

from kernel_testlib import ON_CUDA, generator

from kernels import rms_norm, rms_norm_ref, store_kv, store_kv_ref


@pytest.mark.parametrize(
    "bs,hkv,d,cache_dtype",
    [(16, 2, 64, torch.float32), (32, 3, 64, torch.float32), (16, 1, 128, torch.float16), (16, 8, 64, torch.float16)],
)
def test_store_kv_matches_reference(seed, device, bs, hkv, d, cache_dtype):
    gen = generator(seed)
    nb, T = 7, 23
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[:5]] = -1  # padding tokens write nothing
    # key/value as strided views of one fused QKV row, fp32 (cast on store when the cache is fp16)
    qkv = torch.randn(T, 3 * hkv * d, generator=gen).to(device)
    key = qkv[:, hkv * d : 2 * hkv * d].view(T, hkv, d)
    value = qkv[:, 2 * hkv * d :].view(T, hkv, d)
    slots = slots.to(device)
    kc = torch.full((nb, bs, hkv, d), float("nan"), dtype=cache_dtype, device=device)
    vc, kc_ref, vc_ref = kc.clone(), kc.clone(), kc.clone()
    store_kv(key, value, kc, vc, slots)
    store_kv_ref(key, value, kc_ref, vc_ref, slots)
    # Exact: written slots equal, every other slot still NaN.
    torch.testing.assert_close(kc, kc_ref, equal_nan=True, rtol=0, atol=0, msg=f"k_cache (seed {seed})")
    torch.testing.assert_close(vc, vc_ref, equal_nan=True, rtol=0, atol=0, msg=f"v_cache (seed {seed})")
    written = int((~torch.isnan(kc.view(-1, hkv, d)[:, 0, 0])).sum())
    assert written == int((slots >= 0).sum())


def test_store_kv_all_padding_and_empty(device):
    kc = torch.zeros(2, 16, 1, 64, device=device)
    vc = torch.zeros_like(kc)
    key = torch.randn(3, 1, 64, device=device)
    store_kv(key, key, kc, vc, torch.full((3,), -1, dtype=torch.long, device=device))
    store_kv(key[:0], key[:0], kc, vc, torch.empty(0, dtype=torch.long, device=device))
    assert not kc.any() and not vc.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(seed, device, dtype, with_residual):
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("bf16 is not supported by Triton's CPU interpreter (numpy has no bfloat16)")
    gen = generator(seed)
    rows, hidden = 6, 576  # SmolLM2's hidden size: not a power of two
    x = torch.randn(rows, hidden, generator=gen).to(dtype).to(device)
    w = torch.randn(hidden, generator=gen).to(dtype).to(device)
    r = torch.randn(rows, hidden, generator=gen).to(dtype).to(device) if with_residual else None
    out, new_res = rms_norm(x, w, 1e-5, r)
    want, want_res = rms_norm_ref(x, w, 1e-5, r)
    assert out.dtype == want.dtype and out.shape == want.shape
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, want, rtol=tol, atol=tol, msg=lambda m: f"{m} (seed {seed})")
    torch.testing.assert_close(new_res, want_res, rtol=0, atol=0)
