"""The CPU engine's fused elementwise C kernels (kernels/csrc/elementwise.c) against their torch
references, on fresh random inputs: residual add + RMSNorm, rotary embedding (in place, on views
into a fused qkv row), the KV write (through a shuffled slot mapping with padding slots), SwiGLU."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import kernels.cpu
from kernel_testlib import generator

from kernels import (
    rms_norm_cpu,
    rms_norm_ref,
    rotary_embedding_cpu_,
    rotary_embedding_ref,
    silu_and_mul_cpu,
    silu_and_mul_ref,
    store_kv_cpu,
    store_kv_ref,
)

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 2e-6, atol: float = 2e-6) -> None:
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300: the multi-threaded path
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm(seed, rows, with_residual):
    gen = generator(seed)
    x = torch.randn(rows, 576, generator=gen) * 3
    res = torch.randn(rows, 576, generator=gen) if with_residual else None
    w = torch.randn(576, generator=gen)
    x0, res0 = x.clone(), None if res is None else res.clone()
    out, new_res = rms_norm_cpu(x, w, 1e-5, res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, res)
    _close(out, ref_out)
    _close(new_res, ref_res, rtol=0, atol=0)
    assert torch.equal(x, x0) and (res is None or torch.equal(res, res0)), "inputs must be left untouched"


@pytest.mark.parametrize(("heads", "head_dim"), [(4, 256), (8, 64)])
def test_rms_norm_of_heads_inside_qkv_is_batch_invariant(seed, heads, head_dim):
    """Gemma 3 normalises each head of q and k in place in the fused qkv buffer (a view that is
    not contiguous): a row's result must not depend on the rows beside it (helper-59: the torch
    reference's reduction order did, and greedy tokens changed with speculation on)."""
    gen = generator(seed)
    T = 9
    qkv = torch.randn(T, (heads + 2) * head_dim, generator=gen) * 3
    w = torch.randn(head_dim, generator=gen)
    q = qkv[:, :heads * head_dim].view(T, heads, head_dim)
    assert not q.is_contiguous()
    batch = rms_norm_cpu(q, w, 1e-6)[0]
    _close(batch, rms_norm_ref(q, w, 1e-6)[0])
    for i in (0, 4, T - 1):
        assert torch.equal(rms_norm_cpu(q[i:i + 1], w, 1e-6)[0][0], batch[i])
        assert torch.equal(rms_norm_cpu(q[i:], w, 1e-6)[0][0], batch[i])


@pytest.mark.parametrize("T", [1, 5, 130])
def test_rotary_in_place_on_qkv_views(seed, T, monkeypatch):
    gen = generator(seed)
    Hq, Hk, D = 9, 3, 64
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=gen)
    positions = torch.randint(0, 500, (T,), generator=gen)
    angles = torch.rand(512, D // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1).contiguous()
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1).contiguous()
    expected = qkv.clone()

    def views(t):
        q, k, v = t.split([Hq * D, Hk * D, Hk * D], dim=-1)
        return q.view(T, Hq, D), k.view(T, Hk, D), v

    eq, ek, _ = views(expected)
    rotary_embedding_ref(positions, eq, ek, cos, sin)
    q, k, v = views(qkv)
    # the C kernel, not the fallback, must take these views (one row included: a size-1 dim's
    # stride is arbitrary, so q's and k's row strides differ there and must not matter)
    def no_fallback(*args):
        raise AssertionError("fell back to the torch reference")

    monkeypatch.setattr(kernels.cpu, "rotary_embedding_ref", no_fallback)
    rotary_embedding_cpu_(positions, q, k, cos, sin)
    _close(qkv, expected)
    assert torch.equal(v, views(expected)[2]), "v must be untouched"


def test_store_kv_through_shuffled_slots(seed):
    gen = generator(seed)
    T, Hkv, D, blocks, bs = 37, 3, 64, 20, 16
    kv = torch.randn(T, 2 * Hkv * D + 5, generator=gen)  # views with a row stride != Hkv * D
    key = kv[:, : Hkv * D].view(T, Hkv, D)
    value = kv[:, Hkv * D : 2 * Hkv * D].view(T, Hkv, D)
    slots = torch.randperm(blocks * bs, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[:4]] = -1  # padding tokens
    caches = [torch.full((blocks, bs, Hkv, D), 7.0) for _ in range(4)]
    store_kv_cpu(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    written = (caches[0].view(-1, Hkv, D) != 7.0).any(-1).any(-1).sum().item()
    assert written == int((slots >= 0).sum())


@pytest.mark.parametrize("T", [1, 16, 100])
def test_silu_and_mul(seed, T):
    gen = generator(seed)
    gate_up = torch.randn(T, 2 * 1536, generator=gen) * 8  # wide range: exercises both exp branches
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    _close(silu_and_mul_cpu(gate_up), silu_and_mul_ref(gate_up), rtol=5e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_far_below_the_exp_clamp(dtype):
    """helper-112: exp was clamped at e^-87, so a gate of -3e38 gave about -5 (silu(x) -> 0), and
    -inf gave -inf where x * sigmoid(x) is NaN."""
    gate = torch.tensor([-3e38, -1e30, -100.0, -88.0, -float("inf"), -86.0])
    up = torch.tensor([1.0, 1.0, 1.0, 2.0, 1.0, 1.0])
    got = silu_and_mul_cpu(torch.cat([gate, up])[None].to(dtype))[0].float()
    want = (torch.nn.functional.silu(gate.to(dtype).float()) * up.to(dtype).float())
    assert torch.equal(got[:4].abs(), torch.zeros(4)) and got[4].isnan()
    torch.testing.assert_close(got[5:], want[5:], rtol=1e-2, atol=0)


def test_store_kv_into_fp16_cache(seed):
    """Rounding to half precision is torch's (nearest even), bit for bit."""
    gen = generator(seed)
    T, Hkv, D, blocks, bs = 21, 3, 64, 8, 16
    key = torch.randn(T, Hkv, D, generator=gen) * 100
    value = torch.randn(T, Hkv, D, generator=gen) * 1e-3
    slots = torch.randperm(blocks * bs, generator=gen)[:T]
    caches = [torch.zeros((blocks, bs, Hkv, D), dtype=torch.float16) for _ in range(4)]
    store_kv_cpu(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_store_kv_into_bf16_cache(seed):
    """Rounding to bf16 is torch's (nearest even, infinities kept), bit for bit; a NaN stays a NaN
    (torch's own bit pattern for it differs between its scalar and vector paths)."""
    gen = generator(seed)
    T, Hkv, D, blocks, bs = 21, 3, 64, 8, 16
    key = torch.randn(T, Hkv, D, generator=gen) * 100
    value = torch.randn(T, Hkv, D, generator=gen) * 1e-3
    key[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.0e38])
    value[1, 1, :3] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -0.0])  # ties to even
    slots = torch.randperm(blocks * bs, generator=gen)[:T]
    caches = [torch.zeros((blocks, bs, Hkv, D), dtype=torch.bfloat16) for _ in range(4)]
    store_kv_cpu(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        nan = b.isnan()
        assert torch.equal(a.isnan(), nan)
        assert torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


def test_without_a_compiler_everything_falls_back(tmp_path):
    """No compiler (CC=false, an empty cache): a warning, then the torch references, same results."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch, kernels\n"
        "assert not kernels.cpu_kernels_available()\n"
        "x, w = torch.randn(3, 64), torch.randn(64)\n"
        "assert torch.equal(kernels.rms_norm_cpu(x, w, 1e-5)[0], kernels.rms_norm_ref(x, w, 1e-5)[0])\n"
        "g = torch.randn(2, 32)\n"
        "assert torch.equal(kernels.silu_and_mul_cpu(g), kernels.silu_and_mul_ref(g))\n"
    )
    env = {**os.environ, "CC": "false", "QWORKER_KERNEL_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path)}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "CPU kernels unavailable" in done.stderr


def test_store_kv_refuses_out_of_range_slots(seed):
    """An out-of-range slot raises (as the reference's index_copy_ does) and nothing is written."""
    gen = generator(seed)
    key, value = torch.randn(4, 2, 64, generator=gen), torch.randn(4, 2, 64, generator=gen)
    caches = [torch.zeros(3, 16, 2, 64) for _ in range(2)]
    with pytest.raises(IndexError):
        store_kv_cpu(key, value, caches[0], caches[1], torch.tensor([0, 5, 48, 1]))  # 48 = 3 * 16
    assert not caches[0].any() and not caches[1].any()


@pytest.mark.parametrize("cols", [1, 7, 8, 15, 16, 17, 1000, 49152])
def test_argmax_rows_matches_torch(seed, cols):
    """First index of the maximum (ties, -inf rows, a row of equal values), first NaN when there
    is one, rows of a wider (strided) buffer."""
    from kernels import argmax_rows_cpu

    gen = generator(seed)
    x = torch.randn(9, cols + 3, generator=gen)[:, :cols]  # row stride cols + 3
    x[1] = 0.25  # all equal: index 0
    x[2] = -float("inf")
    if cols > 4:
        x[3, 2] = x[3, cols - 1] = 50.0  # a tie: the first
        x[4, cols // 2] = float("nan")
        x[4, cols - 1] = float("nan")
        x[5, -1] = float("nan")
        x[6, 0] = float("inf")
        x[7, 1] = -0.0
        x[7, 2:] = -1.0
        x[7, 0] = 0.0
    assert torch.equal(argmax_rows_cpu(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows_cpu(x[:0]), x[:0].argmax(dim=-1))
