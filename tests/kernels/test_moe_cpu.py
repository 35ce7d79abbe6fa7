"""The one-call CPU MoE (kernels.moe_cpu, csrc/moe_cpu.c) against the grouped path it replaces
(qworker.model.moe.MoE._grouped: a Linear pair per active expert, torch's gather and index_add_):
the same bits on every shape tried, at one and two threads, whichever build runs the GEMM; and
against an fp64 reference, so the two cannot agree on a wrong answer."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import cpu as kcpu
from kernels import gemm_cpu
from kernels.moe_cpu import PackedExperts
from qworker.model.moe import MoE

pytestmark = pytest.mark.skipif(not kcpu.cpu_kernels_available(), reason="no C compiler for the CPU kernels")


def _layer(E, H, I, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=gen)
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
    return MoE(router, gate_up, down, K, True, "panels", torch.float32, "cpu"), gate_up, down, gen


def _fp64(x, gate_up, down, weights, ids):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, k in itertools.product(range(x.shape[0]), range(ids.shape[1])):
        e = int(ids[t, k])
        g, u = (gate_up[e].double() @ x[t].double()).chunk(2)
        out[t] += weights[t, k].double() * (down[e].double() @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.parametrize("E,H,I,K", [(4, 64, 48, 2), (16, 200, 136, 8), (64, 96, 32, 8), (8, 33, 17, 1)])
@pytest.mark.parametrize("T", [1, 3, 17, 130])
def test_one_call_equals_the_grouped_path_bit_for_bit(E, H, I, K, T):
    moe, gate_up, down, gen = _layer(E, H, I, K, seed=E * 1000 + T)
    assert moe.packed is not None
    x = torch.randn(T, H, generator=gen)
    weights, ids = moe.route(x)
    grouped = moe._grouped(x, weights, ids)
    for threads in (1, 2):
        assert torch.equal(moe.packed(x, ids, weights, threads=threads), grouped), threads
    assert torch.equal(moe(x), grouped)
    torch.testing.assert_close(grouped.double(), _fp64(x, gate_up, down, weights, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", [i for i in kcpu.ISAS if i in kcpu.available_isas()])
def test_any_gemm_build_gives_the_grouped_paths_bits(isa):
    """The kernel runs in the GEMM's build, its SwiGLU in the elementwise kernels' build (the
    grouped path's), whichever builds those are."""
    moe, *_, gen = _layer(16, 128, 64, 4, seed=7)
    x = torch.randn(9, 128, generator=gen)
    weights, ids = moe.route(x)
    with gemm_cpu.using_gemm_isa(isa):
        assert torch.equal(moe.packed(x, ids, weights), moe._grouped(x, weights, ids))


def test_bad_ids_and_shapes_are_refused():
    moe, *_, gen = _layer(4, 64, 48, 2)
    x = torch.randn(3, 64, generator=gen)
    weights, ids = moe.route(x)
    with pytest.raises(ValueError, match="expert id outside"):
        moe.packed(x, torch.full_like(ids, 4), weights)
    with pytest.raises(ValueError, match="fp32 x"):
        moe.packed(x.double(), ids, weights)
    with pytest.raises(ValueError, match="one of each per expert"):
        PackedExperts([], [], 64, 48)


def test_biased_or_clamped_experts_keep_the_grouped_path():
    """gpt-oss's biases and clamped SwiGLU, Llama 4's input scaling: not what the kernel computes."""
    gen = torch.Generator().manual_seed(1)
    E, H, I = 4, 32, 16
    args = (torch.randn(E, H, generator=gen), torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen), 2, True,
            "panels", torch.float32, "cpu")
    assert MoE(*args, gate_up_bias=torch.randn(E, 2 * I, generator=gen)).packed is None
    assert MoE(*args, clamped_swiglu=(1.702, 7.0)).packed is None
    assert MoE(*args, scale_inputs=True).packed is None
    assert MoE(*args).packed is not None


def test_more_than_64_experts_per_token_keep_the_grouped_path():
    """helper-104: top-k 65 of 80 experts took the kernel, which refuses more than 64 a token:
    every forward raised."""
    gen = torch.Generator().manual_seed(2)
    moe = MoE(torch.randn(80, 32, generator=gen), torch.randn(80, 32, 32, generator=gen), torch.randn(80, 32, 16, generator=gen), 65, True,
              "panels", torch.float32, "cpu")
    assert moe.packed is None
    x = torch.randn(3, 32, generator=gen)
    assert torch.equal(moe(x), moe._grouped(x, *moe.route(x)))


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv("QWORKER_CPU_MOE_KERNEL", "0")
    assert _layer(4, 64, 48, 2)[0].packed is None
    monkeypatch.setenv("QWORKER_CPU_MOE_KERNEL", "1")
    assert _layer(4, 64, 48, 2)[0].packed is not None
