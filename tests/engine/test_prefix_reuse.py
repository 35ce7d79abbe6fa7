"""Prefix reuse is measured, not assumed: 8 requests sharing a 384-token system prompt."""

from __future__ import annotations

import random

from qworker import LLM, SamplingParams

SHARED_TOKENS = 384


def workload(tokenizer, rng: random.Random) -> tuple[list[list[int]], int]:
    words = "river stone garden winter light market station harbour letter engine quiet morning".split()
    system = tokenizer.encode("You are a careful assistant. " + " ".join(rng.choice(words) for _ in range(600)))[:SHARED_TOKENS]
    questions = [f" Question {i}: what is the {rng.choice(words)} of the {rng.choice(words)}?" for i in range(8)]
    return [system + tokenizer.encode(q) for q in questions], len(system)


def test_shared_system_prompt_is_computed_once(model_dir):
    rng = random.Random()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cold = LLM(str(model_dir), enable_prefix_caching=False)
    prompts, shared = workload(cold.tokenizer, rng)
    base = cold.generate(prompts, params)
    computed_off = cold.stats()["prompt_tokens_computed"]

    warm = LLM(str(model_dir), enable_prefix_caching=True)
    outs = warm.generate(prompts, params)
    stats = warm.stats()
    computed_on = stats["prompt_tokens_computed"]

    total_shared = shared * len(prompts)
    assert computed_off == sum(len(p) for p in prompts)
    # at least 80% of the shared part is not recomputed
    assert computed_off - computed_on >= 0.8 * total_shared, (computed_off, computed_on, total_shared)
    assert stats["prefix_cache_hits"] >= 0.8 * (total_shared - shared)
    assert sum(o.num_cached_tokens for o in outs) >= 0.8 * (total_shared - shared)
    # outputs are unchanged by caching
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
