"""Triton rotary embedding and SwiGLU against their torch references, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernel_testlib import ON_CUDA, generator

from kernels import rotary_embedding, rotary_embedding_ref, silu_and_mul, silu_and_mul_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _exact(dtype, magnitude: float) -> dict:
    """Bit for bit, except bf16 under Triton's CPU interpreter: its fp32 -> bf16 cast truncates
    where the GPU rounds to nearest even, so there each of the three roundings may be one ulp
    of ``magnitude`` off (the exact check of bf16 runs on CUDA)."""
    if dtype == torch.bfloat16 and not ON_CUDA:
        return dict(rtol=0, atol=3 * 2.0**-7 * magnitude)
    return dict(rtol=0, atol=0)


def _tables(max_pos: int, dim: int, dtype, device, scale: float = 1.0):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    emb = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    emb = torch.cat([emb, emb], dim=-1)
    return (emb.cos() * scale).to(device, dtype), (emb.sin() * scale).to(device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (4, 4, 32), (5, 1, 24)])
def test_rotary_on_fused_qkv_views_matches_reference(seed, device, dtype, hq, hk, d):
    gen = generator(seed)
    T, max_pos = 13, 300
    # q and k as strided views of one fused qkv row, as the model hands them over
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=gen) * 3).to(device, dtype)
    positions = torch.randint(0, max_pos, (T,), generator=gen).to(device)
    cos, sin = _tables(max_pos, d, dtype, device, scale=1.3)
    ref, before = qkv.clone(), qkv.clone()

    def views(t):
        return t[:, : hq * d].view(T, hq, d), t[:, hq * d : (hq + hk) * d].view(T, hk, d)

    rotary_embedding(positions, *views(qkv), cos, sin)
    rotary_embedding_ref(positions, *views(ref), cos, sin)
    assert not torch.equal(qkv[:, : hq * d], before[:, : hq * d])  # q was rotated
    magnitude = float(qkv.abs().max()) * 1.3
    torch.testing.assert_close(qkv, ref, **_exact(dtype, magnitude), msg=f"seed {seed}")
    v_start = (hq + hk) * d
    assert torch.equal(qkv[:, v_start:], ref[:, v_start:])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_partial_heads_rotate_only_the_first_channels(seed, device, dtype):
    gen = generator(seed)
    T, hq, hk, head, rot = 6, 4, 2, 64, 16
    q = torch.randn(T, hq, head, generator=gen).to(device, dtype)
    k = torch.randn(T, hk, head, generator=gen).to(device, dtype)
    positions = torch.arange(T, device=device) * 7
    cos, sin = _tables(64, rot, dtype, device)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding(positions, q[..., :rot], k[..., :rot], cos, sin)
    rotary_embedding_ref(positions, q_ref[..., :rot], k_ref[..., :rot], cos, sin)
    torch.testing.assert_close(q, q_ref, **_exact(dtype, 8.0))
    torch.testing.assert_close(k, k_ref, **_exact(dtype, 8.0))
    assert torch.equal(q[..., rot:], q_ref[..., rot:]) and torch.equal(k[..., rot:], k_ref[..., rot:])


def test_rotary_takes_strided_positions(device):
    q = torch.randn(4, 2, 8, device=device)
    k = torch.randn(4, 1, 8, device=device)
    cos, sin = _tables(16, 8, torch.float32, device)
    pos = torch.tensor([[3, 0], [9, 0], [1, 0], [15, 0]], device=device)[:, 0]  # stride 2
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding(pos, q, k, cos, sin)
    rotary_embedding_ref(pos.contiguous(), q_ref, k_ref, cos, sin)
    torch.testing.assert_close(q, q_ref, rtol=0, atol=0)
    torch.testing.assert_close(k, k_ref, rtol=0, atol=0)


def test_rotary_position_zero_is_identity_and_empty_is_a_no_op(device):
    q = torch.randn(3, 2, 8, device=device)
    k = torch.randn(3, 1, 8, device=device)
    cos, sin = _tables(4, 8, torch.float32, device)
    q0, k0 = q.clone(), k.clone()
    rotary_embedding(torch.zeros(3, dtype=torch.long, device=device), q, k, cos, sin)
    torch.testing.assert_close(q, q0, rtol=0, atol=0)
    torch.testing.assert_close(k, k0, rtol=0, atol=0)
    rotary_embedding(torch.zeros(0, dtype=torch.long, device=device), q[:0], k[:0], cos, sin)


def test_rotary_refuses_what_it_cannot_rotate(device):
    q = torch.randn(3, 2, 8, device=device)
    k = torch.randn(3, 1, 8, device=device)
    pos = torch.zeros(3, dtype=torch.long, device=device)
    cos, sin = _tables(4, 8, torch.float32, device)
    with pytest.raises(ValueError, match="tables"):
        rotary_embedding(pos, q, k, cos[:, :6], sin[:, :6])
    with pytest.raises(ValueError, match="tables"):
        rotary_embedding(pos, q, k, cos.half(), sin.half())
    with pytest.raises(ValueError, match="disagree"):
        rotary_embedding(pos[:2], q, k, cos, sin)
    with pytest.raises(ValueError, match="contiguous channels"):
        rotary_embedding(pos, q[..., ::2], k[..., ::2], cos[:, :4], sin[:, :4])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 576), (2, 3, 2 * 40), (1, 2 * 1536)])
def test_silu_and_mul_matches_reference(seed, device, dtype, shape):
    gen = generator(seed)
    x = (torch.randn(*shape, generator=gen) * 4).to(device, dtype)
    x.view(-1)[:3] = torch.tensor([0.0, -30.0, 30.0])  # silu's flat and linear ends
    out = silu_and_mul(x)
    ref = silu_and_mul_ref(x)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # The GPU's exp (ex2.approx) may differ from torch's by an ulp or two in fp32. In 16 bits that
    # rarely moves the rounded silu, and when it does, by one ulp, which the product can carry
    # into one more ulp: two ulps relative, or the smallest normal for products in the subnormals
    # (seen on the H200: fp16, 1 of 3072 values). Under the CPU interpreter bf16 casts truncate
    # (see _exact): two ulps as well.
    eps = torch.finfo(dtype).eps
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=2 * eps, atol=torch.finfo(dtype).tiny)
    torch.testing.assert_close(out, ref, **tol, msg=f"seed {seed}")


def test_silu_and_mul_strided_input_and_odd_width(device):
    x = torch.randn(4, 2 * 64, device=device)[:, :100]  # a row-strided view
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="equal width"):
        silu_and_mul(torch.randn(2, 7, device=device))
    assert silu_and_mul(torch.randn(0, 8, device=device)).shape == (0, 4)
