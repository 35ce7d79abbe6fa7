"""The Triton fused mixture-of-experts (kernels.moe_experts) against its torch reference, under the
interpreter on CPU (natively on CUDA): tiny shapes whose sizes are not multiples of the tiles, one
token, experts with no tokens, one expert with every token; the expert-sorted padded layout it reads;
and the MoE layer's Triton backend against its CPU backend."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import kernels
from kernel_testlib import ON_CUDA, assert_close, generator

if not ON_CUDA and "kernels.fused_moe" in sys.modules:  # imported compiled by an earlier test
    importlib.reload(sys.modules["kernels.fused_moe"])


def _route(gen, T, E, K):
    logits = torch.randn(T, E, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _weights(gen, E, H, I, dtype, device):
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype).to(device)
    down = (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype).to(device)
    return gate_up, down


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,E,K,H,I,blocks", [
    (1, 4, 2, 40, 24, (16, 16, 16)),  # one token: 2 experts run, 2 get nothing
    (13, 5, 2, 40, 24, (16, 16, 16)),  # H, I not multiples of the tiles; several N and K tiles
    (21, 6, 3, 32, 48, (None, None, None)),  # the launcher's own tile sizes
    (40, 3, 1, 24, 16, (32, 16, 16)),  # groups larger than one tile
    (100, 4, 2, 32, 32, (None, None, None)),  # ~50 pairs per expert: the launcher's 64-row tiles
])
def test_moe_experts_matches_reference(seed, device, dtype, T, E, K, H, I, blocks):
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("bf16 is not supported by Triton's CPU interpreter (numpy has no bfloat16)")
    gen = generator(seed)
    gate_up, down = _weights(gen, E, H, I, dtype, device)
    x = torch.randn(T, H, generator=gen).to(dtype).to(device)
    weights, ids = _route(gen, T, E, K)
    weights, ids = weights.to(device), ids.to(device)
    bm, bn, bk = blocks
    for in_act in (False, True):
        out = kernels.moe_experts(x, gate_up, down, weights, ids, in_act, block_m=bm, block_n=bn, block_k=bk)
        ref = kernels.moe_experts_ref(x, gate_up, down, weights, ids, in_act)
        assert out.dtype == dtype
        assert_close(out, ref, dtype, f"T={T} E={E} K={K} in_act={in_act}")


def test_one_expert_gets_every_token(seed, device):
    gen = generator(seed)
    T, E, K, H, I = 37, 5, 2, 32, 16
    gate_up, down = _weights(gen, E, H, I, torch.float32, device)
    x = torch.randn(T, H, generator=gen).to(device)
    ids = torch.stack([torch.full((T,), 2), torch.randint(3, 5, (T,), generator=gen)], dim=1).to(device)
    weights = torch.rand(T, K, generator=gen).to(device)
    out = kernels.moe_experts(x, gate_up, down, weights, ids, block_m=16, block_n=16, block_k=16)
    assert_close(out, kernels.moe_experts_ref(x, gate_up, down, weights, ids), torch.float32, "expert 2 everywhere")


@pytest.mark.parametrize("block_m", [16, 64])
def test_moe_align_layout(seed, block_m):
    """Every (token, slot) pair exactly once, each tile one expert's, a group's pairs in order,
    padding and the unused tail masked (== T*K), tiles past the last group marked -1."""
    gen = generator(seed)
    T, E, K = 29, 7, 3
    ids = _route(gen, T, E, K)[1]
    ids[ids == 5] = 6  # expert 5 gets no token
    sorted_ids, block_expert = kernels.moe_align(ids, E, block_m)
    M = T * K
    assert sorted_ids.numel() == block_expert.numel() * block_m
    real = sorted_ids[sorted_ids < M]
    assert sorted(real.tolist()) == list(range(M))
    assert ((sorted_ids == M) | (sorted_ids < M)).all()
    flat = ids.flatten()
    tiles = sorted_ids.view(-1, block_m)
    seen = []
    for tile, expert in zip(tiles.tolist(), block_expert.tolist()):
        members = [i for i in tile if i < M]
        if expert < 0:
            assert not members
            continue
        assert members and all(flat[i] == expert for i in members)
        assert members == sorted(members)
        seen.append(expert)
    assert seen == sorted(seen) and 5 not in seen
    assert (block_expert[len(seen):] == -1).all()


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_layer_triton_backend_matches_cpu_backend(seed, device, renormalize):
    """qworker's MoE layer: the routing is shared, the experts run by the fused kernel or by the
    expert-grouped Linear GEMMs."""
    from qworker.model.moe import MoE

    gen = generator(seed)
    E, H, I, K = 6, 40, 24, 2
    router = torch.randn(E, H, generator=gen)
    gate_up, down = _weights(gen, E, H, I, torch.float32, "cpu")
    x = torch.randn(19, H, generator=gen)
    cpu = MoE(router, gate_up, down, K, renormalize, "matmul", torch.float32, "cpu")
    tri = MoE(router.to(device), gate_up.to(device), down.to(device), K, renormalize, "transposed", torch.float32, "triton")
    for rows in (x[:1], x):
        assert_close(tri(rows.to(device)), cpu(rows), torch.float32, f"{rows.shape[0]} tokens")


def test_no_tokens(device):
    gate_up, down = _weights(generator(0), 3, 16, 16, torch.float32, device)
    x = torch.empty(0, 16, device=device)
    out = kernels.moe_experts(x, gate_up, down, torch.empty(0, 2, device=device), torch.empty(0, 2, dtype=torch.int64, device=device))
    assert out.shape == (0, 16)


def test_moe_align_grid_is_bounded_by_the_pairs_not_the_experts():
    """One token's 4 experts out of 64: 4 tiles, each one expert's, not a tile per expert."""
    ids = torch.tensor([[40, 3, 17, 63]])
    sorted_ids, block_expert = kernels.moe_align(ids, 64, 16)
    assert block_expert.tolist() == [3, 17, 40, 63]
    assert sorted_ids.view(4, 16)[:, 0].tolist() == [1, 2, 0, 3] and (sorted_ids.view(4, 16)[:, 1:] == 4).all()
