"""Sampling parameters and stop conditions, on the tiny random model (fast) and the real one."""

from __future__ import annotations

import random

import pytest

from qworker import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory=8 << 20)


def rand_prompt(rng, n):
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_seeded_sampling_independent_of_batch(tiny):
    rng = random.Random()
    prompt = rand_prompt(rng, 12)
    seed = rng.randrange(1 << 30)
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=seed, ignore_eos=True)
    alone = tiny.generate([prompt], p)[0].outputs[0].token_ids
    others = [rand_prompt(rng, rng.randrange(3, 30)) for _ in range(5)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = tiny.generate(others[:2] + [prompt] + others[2:], [unseeded, unseeded, p, unseeded, unseeded, unseeded])
    assert mixed[2].outputs[0].token_ids == alone


def test_fork_equals_independent_seeded_runs(tiny):
    rng = random.Random()
    prompt = rand_prompt(rng, 21)  # ends mid-block: the shared partial block must be copied on write
    seed = rng.randrange(1 << 30)
    kw = dict(temperature=0.9, max_tokens=10, ignore_eos=True)
    forked = tiny.generate([prompt], SamplingParams(n=3, seed=seed, **kw))[0]
    assert [c.index for c in forked.outputs] == [0, 1, 2]
    singles = [tiny.generate([prompt], SamplingParams(seed=seed + i, **kw))[0].outputs[0].token_ids for i in range(3)]
    assert [c.token_ids for c in forked.outputs] == singles
    assert tiny.stats()["cow_copies"] >= 2  # every child but the last writer copied the tail block
    assert tiny.stats()["kv_blocks_used"] == 0


def test_top_k_one_is_greedy_and_min_p_one_is_greedy(tiny):
    prompt = rand_prompt(random.Random(), 10)
    greedy = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    top1 = tiny.generate([prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    minp = tiny.generate([prompt], SamplingParams(temperature=1.5, min_p=1.0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    assert top1 == greedy == minp


def test_max_tokens_min_tokens_and_stop_token_ids(tiny):
    rng = random.Random()
    prompt = rand_prompt(rng, 9)
    free = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert len(free.token_ids) == 12 and free.finish_reason == "length"
    stop_tok = free.token_ids[4]
    first = free.token_ids.index(stop_tok)
    out = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == free.token_ids[: first + 1]
    # min_tokens bans the stop token until reached, so the output goes on past it
    out = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2, stop_token_ids=[stop_tok], ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) >= first + 2


def test_penalties_change_repetitive_greedy_output(tiny):
    prompt = rand_prompt(random.Random(), 8)
    base = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0].token_ids
    assert len(set(base)) < len(base), "the random model repeats itself under greedy decoding"
    pen = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True))[0].outputs[0].token_ids
    rep = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=24, repetition_penalty=10.0, ignore_eos=True))[0].outputs[0].token_ids
    assert len(set(pen)) > len(set(base))
    # a strong repetition penalty never picks a token already in the prompt or output when others remain
    assert len(set(rep)) == len(rep) and not set(rep) & set(prompt)


def test_logprobs_top_n_and_sampled(tiny):
    prompt = rand_prompt(random.Random(), 7)
    out = tiny.generate([prompt], SamplingParams(temperature=1.0, max_tokens=5, logprobs=3, seed=1, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp
        assert 3 <= len(lp) <= 4
        assert all(v.logprob <= 0 for v in lp.values())
        top3 = sorted((v.logprob for v in lp.values()), reverse=True)[:3]
        assert lp[tok].logprob <= top3[0] + 1e-6


def test_stop_string_cut_and_not_emitted(model_dir):
    llm = LLM(str(model_dir), kv_cache_memory=16 << 20)
    prompt = "Count: one, two, three, four, five, six,"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    assert " eight" in free, free
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, stop=[" eight"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " eight"
    assert out.text == free[: free.index(" eight")]


def test_chat_prompt_uses_template(model_dir):
    llm = LLM(str(model_dir), kv_cache_memory=16 << 20)
    msgs = [{"role": "user", "content": "Say hello."}]
    out = llm.generate(msgs, SamplingParams(temperature=0, max_tokens=8))[0]
    templated = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.prompt_token_ids == list(templated)
    assert out.outputs[0].text


def test_a_row_without_top_p_is_not_cut_by_its_batch() -> None:
    """helper-49: once any row of a step had top_p < 1 the nucleus cut ran on every row, and a
    top_p = 1 row whose fp32 cumulative mass reached 1 before the vocabulary's end lost its tail:
    a seeded request drew another token beside such a row than alone. Its probabilities must be
    the same bits alone and batched."""
    from types import SimpleNamespace

    import torch

    from qworker.engine.sampler import _filtered_probs

    def seq(**kw):
        return SimpleNamespace(request=SimpleNamespace(params=SamplingParams(temperature=1.0, **kw)))

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 49152, generator=gen) * 3
    plain, nucleus = seq(seed=20), seq(top_p=0.9)
    alone = _filtered_probs(logits[:1].clone(), [plain])
    batched = _filtered_probs(logits.clone(), [plain, nucleus])
    assert (alone > 0).sum() == logits.shape[1], "a top_p = 1 row keeps every token"
    assert torch.equal(batched[0], alone[0])
    assert (batched[1] == 0).any(), "the top_p = 0.9 row is still cut"
