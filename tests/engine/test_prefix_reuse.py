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


def test_a_recomputed_sequence_does_not_hit_another_jobs_prefill_of_its_outputs(family_models):
    """helper-101: a sequence coming back after a recompute preemption looked up its outputs'
    blocks too, and took those of an earlier job whose prompt repeated its prompt and part of its
    output: KV written by the prefill kernel at what are decode positions for it, so its later
    logprobs moved by an ulp (its own prompt repeats nothing: the README's exception is not it).
    Pool of 9 blocks, 32-token budget: the higher-priority job D arriving when C has 30 outputs
    preempts C (recompute: no swap space)."""
    from qworker.engine import EngineConfig, LLMEngine

    model = str(family_models.get("mistral"))
    block_bytes = 3 * 2 * 2 * 16 * 16 * 4  # layers x (k, v) x kv heads x head_dim x block_size x fp32

    def run(engine, rid, prompt, params, priority=0, arrive=None):
        engine.add_request(rid, prompt, params, priority=priority)
        done, arrived = None, arrive is None
        while engine.has_unfinished():
            if not arrived and engine.requests[rid].seqs[0].num_output_tokens >= 30:
                engine.add_request(*arrive, priority=0)
                arrived = True
            for out in engine.step():
                if out.finished and out.request_id == rid:
                    done = out
        return done.seqs[0]

    prompt = list(range(1000, 1020))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    alone = run(LLMEngine(EngineConfig(model=model, kv_cache_memory=64 * block_bytes, enable_prefix_caching=False)), "C", prompt, params)
    output = list(alone.output_token_ids)
    late = ("D", list(range(5000, 5088)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    engine = LLMEngine(EngineConfig(model=model, kv_cache_memory=9 * block_bytes, swap_space=0, max_num_batched_tokens=32))
    run(engine, "B", prompt + output[:29], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    crowded = run(engine, "C", prompt, params, priority=1, arrive=late)
    assert engine.stats()["preemptions_recompute"] >= 1, "the scenario no longer preempts C: rebuild it"
    assert list(crowded.output_token_ids) == output
    assert [repr(lp) for lp in crowded.logprobs] == [repr(lp) for lp in alone.logprobs]
