"""DeepSeek-V2/V3 and GLM-4.5 routing (qworker.model.moe.Routing) against transformers' own routers
and expert blocks holding the same weights, in fp32: for every token the same experts with the same
weights, and the same routed output up to GEMM rounding. The cases cover expert groups (the best
expert or the best two deciding a group), a choice bias large enough to change the pick, and
renormalisation on and off."""

from __future__ import annotations

import pytest
import torch

from qworker.model.moe import MoE, Routing

E, H, I, TOP_K = 16, 48, 24, 4


def _hf(family: str, **routing):
    """transformers' (router, experts) for ``family`` with these routing options."""
    if family == "deepseek_v2":
        from transformers import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Experts as Experts, DeepseekV2TopkRouter as Router

        config = DeepseekV2Config(hidden_size=H, num_attention_heads=4, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=TOP_K, **routing)
    elif family == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts as Experts, DeepseekV3TopkRouter as Router

        config = DeepseekV3Config(hidden_size=H, num_attention_heads=4, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=TOP_K, **routing)
    else:
        from transformers import Glm4MoeConfig
        from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeExperts as Experts, Glm4MoeTopkRouter as Router

        config = Glm4MoeConfig(hidden_size=H, num_attention_heads=4, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=TOP_K, **routing)
    return Router(config).eval(), Experts(config).eval(), config


def _routing(family: str, config) -> tuple[Routing, bool]:
    """The engine's routing for the config, as qworker.model.families.deepseek reads it."""
    if family == "deepseek_v2":
        groups = (config.n_group, config.topk_group, "max") if config.topk_method == "group_limited_greedy" else None
        return Routing("softmax", None, groups, config.routed_scaling_factor), False
    return Routing("sigmoid", None, (config.n_group, config.topk_group, "top2"), config.routed_scaling_factor), config.norm_topk_prob


CASES = [
    ("deepseek_v2", dict(topk_method="greedy", routed_scaling_factor=1.0)),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0)),
    ("deepseek_v3", dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)),
    ("deepseek_v3", dict(n_group=8, topk_group=3, routed_scaling_factor=1.0, norm_topk_prob=False)),
    ("glm4_moe", dict(n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
]


@pytest.mark.parametrize("family,options", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_routing_and_routed_output_match_transformers(family, options):
    gen = torch.Generator().manual_seed(len(family) * 7 + len(options))
    router, experts, config = _hf(family, **options)
    weight = torch.randn(E, H, generator=gen)
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen) / H**0.5, torch.randn(E, H, I, generator=gen) / I**0.5
    routing, renormalize = _routing(family, config)
    with torch.no_grad():
        router.weight.copy_(weight)
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        if hasattr(router, "e_score_correction_bias"):
            # large enough to move experts into and out of the pick (sigmoid scores are in (0, 1))
            bias = torch.randn(E, generator=gen) * 0.3
            router.e_score_correction_bias.copy_(bias)
            routing = Routing(routing.scoring, bias, routing.groups, routing.routed_scale)
    moe = MoE(weight, gate_up, down, TOP_K, renormalize, "matmul", torch.float32, "cpu", routing=routing)
    unbiased = MoE(weight, gate_up, down, TOP_K, renormalize, "matmul", torch.float32, "cpu",
                   routing=Routing(routing.scoring, None, routing.groups, routing.routed_scale))
    for T in (1, 5, 96):
        x = torch.randn(T, H, generator=gen) * 2
        with torch.no_grad():
            _, hf_weights, hf_ids = router(x)
            expected = experts(x, hf_ids, hf_weights)
        weights, ids = moe.route(x)
        order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
        assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order)), (family, T)
        assert torch.equal(weights.gather(1, order), hf_weights.gather(1, hf_order)), (family, T)  # the same fp32 ops
        torch.testing.assert_close(moe(x), expected, rtol=1e-4, atol=1e-5)
        if routing.choice_bias is not None and T == 96:  # the bias decides some picks here
            assert not torch.equal(unbiased.route(x)[1].sort(dim=-1)[0], ids.sort(dim=-1)[0])
    if routing.groups is not None and routing.groups[1] < routing.groups[0]:  # every pick inside the kept groups
        n, kept, _ = routing.groups
        assert all(len({e // (E // n) for e in row}) <= kept for row in moe.route(torch.randn(64, H, generator=gen))[1].tolist())


@pytest.mark.parametrize("groups,top_k,why", [((3, 1, "top2"), 2, "cannot route"), ((4, 5, "max"), 2, "cannot route"),
                                               ((16, 1, "top2"), 1, "best two"), ((8, 1, "max"), 4, "more than the 2 experts")])
def test_routing_a_config_cannot_describe_is_one_clear_error(groups, top_k, why):
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=why):
        MoE(torch.randn(E, H, generator=gen), torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen), top_k, False,
            "matmul", torch.float32, "cpu", routing=Routing("softmax", None, groups))


@pytest.mark.parametrize("jitter_eps", [0.01, 0.3, 2.0])
def test_sparsemixer_matches_transformers(jitter_eps):
    """Phi-3.5-MoE's SparseMixer top-2 at inference, against transformers' own function: the same
    experts and the same weights, to the bit (ties in the logits included)."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    gen = torch.Generator().manual_seed(int(jitter_eps * 100))
    router = torch.randn(E, H, generator=gen)
    router[5] = router[3]  # experts 3 and 5 tie on every token
    moe = MoE(router, torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen), 2, False,
              "matmul", torch.float32, "cpu", routing=Routing("sparsemixer", jitter_eps=jitter_eps))
    x = torch.randn(200, H, generator=gen)
    logits = torch.nn.functional.linear(x, moe.router)
    hf_weights, hf_ids = sparsemixer(logits, jitter_eps, training=False)
    weights, ids = moe.route(x)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    assert ((ids == 3) | (ids == 5)).all(dim=-1).any(), "no token picked the tied pair"
