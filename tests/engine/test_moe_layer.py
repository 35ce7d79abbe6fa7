"""The CPU mixture-of-experts layer (qworker.model.moe.MoE, expert-grouped GEMMs through the Linear
backends) against a per-token loop written from the definition, and against transformers' own
sparse MoE blocks (Mixtral, Qwen3-MoE, OLMoE) holding the same weights, in fp32: the same experts
chosen for every token and the same outputs up to GEMM rounding. Covers one token, experts that get
no token, and a batch where one expert gets every token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qworker.model.linear import onednn_supported, panels_supported
from qworker.model.moe import MoE

BACKENDS = ["matmul"] + (["onednn"] if onednn_supported(torch.float32)[0] else []) + (["panels"] if panels_supported(torch.float32)[0] else [])


def per_token_reference(x, router, gate_up, down, top_k, renormalize):
    """Token by token, expert by expert, in float64: the definition, sharing no code with MoE."""
    x, router, gate_up, down = (t.double() for t in (x, router, gate_up, down))
    I = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(router @ x[t], dim=0)
        chosen = sorted(range(len(probs)), key=lambda e: -probs[e].item())[:top_k]
        total = sum(probs[e] for e in chosen) if renormalize else 1.0
        for e in chosen:
            g, u = gate_up[e, :I] @ x[t], gate_up[e, I:] @ x[t]
            out[t] += probs[e] / total * (down[e] @ (F.silu(g) * u))
    return out.float()


def random_weights(gen, E, H, I):
    return (torch.randn(E, H, generator=gen), torch.randn(E, 2 * I, H, generator=gen) / H**0.5,
            torch.randn(E, H, I, generator=gen) / I**0.5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,top_k,renormalize", [(1, 2, True), (5, 2, False), (40, 3, True), (17, 1, False)])
def test_grouped_moe_matches_per_token_loop(backend, T, top_k, renormalize):
    gen = torch.Generator().manual_seed(1000 * T + top_k)
    E, H, I = 8, 48, 40
    router, gate_up, down = random_weights(gen, E, H, I)
    x = torch.randn(T, H, generator=gen)
    moe = MoE(router, gate_up, down, top_k, renormalize, backend, torch.float32, "cpu")
    out = moe(x)
    assert out.shape == (T, H) and out.dtype == torch.float32
    torch.testing.assert_close(out, per_token_reference(x, router, gate_up, down, top_k, renormalize), rtol=1e-4, atol=1e-5)
    if T == 1:  # one token reaches top_k of the 8 experts: the others run nothing
        assert len(set(moe.route(x)[1].flatten().tolist())) == top_k


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_one_expert_gets_every_token(backend, top_k):
    """A feature every token has, to which only expert 3 responds: expert 3 is every token's first
    choice (with top_k=1 it runs the whole batch and the others nothing)."""
    gen = torch.Generator().manual_seed(3)
    E, H, I, T = 6, 32, 24, 23
    router, gate_up, down = random_weights(gen, E, H, I)
    router[:, 0] = 0.0
    router[3, 0] = 4.0
    x = torch.randn(T, H, generator=gen)
    x[:, 0] = 10.0
    moe = MoE(router, gate_up, down, top_k, True, backend, torch.float32, "cpu")
    ids = moe.route(x)[1]
    assert (ids[:, 0] == 3).all()
    torch.testing.assert_close(moe(x), per_token_reference(x, router, gate_up, down, top_k, True), rtol=1e-4, atol=1e-5)


def _hf_block(family: str, E: int, H: int, I: int, top_k: int, norm_topk_prob: bool):
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block

        config = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=top_k)
        renormalize = True  # Mixtral's softmax over its top-k
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=top_k,
                                norm_topk_prob=norm_topk_prob)
        renormalize = norm_topk_prob
    else:
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock as Block

        config = OlmoeConfig(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=top_k,
                             norm_topk_prob=norm_topk_prob)
        renormalize = norm_topk_prob
    return Block(config).eval(), renormalize


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family,norm_topk_prob", [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False),
                                                    ("olmoe", False), ("olmoe", True)])
def test_matches_transformers_sparse_moe_block(backend, family, norm_topk_prob):
    gen = torch.Generator().manual_seed(len(family) + norm_topk_prob)
    E, H, I, top_k = 10, 64, 32, 3
    block, renormalize = _hf_block(family, E, H, I, top_k, norm_topk_prob)
    router, gate_up, down = random_weights(gen, E, H, I)
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    moe = MoE(router, gate_up, down, top_k, renormalize, backend, torch.float32, "cpu",
              weights_in_act_dtype=family != "mixtral")
    for T in (1, 3, 64):  # with 3 tokens at most 9 of the 10 experts run
        x = torch.randn(T, H, generator=gen)
        with torch.no_grad():
            _, hf_weights, hf_ids = block.gate(x)
            expected = block(x[None])[0]
        weights, ids = moe.route(x)
        assert torch.equal(ids, hf_ids), (family, T)
        assert torch.equal(weights, hf_weights), (family, T)  # the same fp32 ops: the same bits
        torch.testing.assert_close(moe(x), expected, rtol=1e-4, atol=1e-5)


def test_tied_router_rows_pick_the_same_experts_as_transformers():
    """Two experts with the same router row tie on every token; torch.topk settles it, identically."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: F401

    gen = torch.Generator().manual_seed(11)
    E, H, I, top_k = 6, 32, 16, 2
    block, _ = _hf_block("mixtral", E, H, I, top_k, True)
    router, gate_up, down = random_weights(gen, E, H, I)
    router[4] = router[1]
    with torch.no_grad():
        block.gate.weight.copy_(router)
    moe = MoE(router, gate_up, down, top_k, True, "matmul", torch.float32, "cpu")
    x = torch.randn(50, H, generator=gen)
    with torch.no_grad():
        hf_ids = block.gate(x)[2]
    assert torch.equal(moe.route(x)[1], hf_ids)


def test_bad_shapes_are_one_clear_error():
    gen = torch.Generator().manual_seed(0)
    router, gate_up, down = random_weights(gen, 4, 16, 8)
    with pytest.raises(ValueError, match="MoE weights disagree"):
        MoE(router[:3], gate_up, down, 2, True, "matmul", torch.float32, "cpu")
    with pytest.raises(ValueError, match="top_k"):
        MoE(router, gate_up, down, 5, True, "matmul", torch.float32, "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_weights_with_fp32_activations(backend):
    """The CPU bf16 mode: bf16 expert weights, fp32 activations in and out (each GEMM's input
    rounded to bf16, fp32 accumulation), against the fp32 loop over the same rounded weights."""
    if backend == "onednn" and not onednn_supported(torch.bfloat16)[0]:
        pytest.skip("oneDNN's bf16 linear is unavailable on this CPU")
    if backend == "panels" and not panels_supported(torch.bfloat16)[0]:
        pytest.skip(f"the panels GEMM is unavailable: {panels_supported(torch.bfloat16)[1]}")
    gen = torch.Generator().manual_seed(5)
    E, H, I, T = 6, 64, 32, 9
    router, gate_up, down = random_weights(gen, E, H, I)
    x = torch.randn(T, H, generator=gen)
    moe = MoE(router, gate_up.bfloat16(), down.bfloat16(), 2, True, backend, torch.float32, "cpu")
    out = moe(x)
    assert out.dtype == torch.float32
    ref = per_token_reference(x, router, gate_up.bfloat16().float(), down.bfloat16().float(), 2, True)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_empty_step():
    gen = torch.Generator().manual_seed(0)
    moe = MoE(*random_weights(gen, 4, 16, 8), 2, True, "matmul", torch.float32, "cpu")
    assert moe(torch.empty(0, 16)).shape == (0, 16)
