"""Speculative decoding (issue 16): config, the n-gram index, the verification sampler, and the
engine with speculation on against the engine with it off.

Engine runs use the tiny model with its logits replaced by a bigram table (``spec_support``), so
drafts are accepted and rejected in a mix and outputs compare exactly: greedy and seeded sampling
must give the same tokens, text, finish and stop reasons and logprobs with speculation on or off,
under preemption (swap and recompute), with forks, stop strings and ids inside accepted runs,
penalties, min_tokens, structured output and failed steps; every block comes back.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch

from qworker.engine import EngineConfig, SamplingParams
from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.outputs import RequestMetrics
from qworker.engine.sequence import Request, Sequence
from qworker.engine.spec_decode import AutoPolicy, NgramIndex, SpeculativeConfig, propose
from qworker.engine.spec_decode.policy import CostModel
from qworker.engine.spec_decode.verify import verify
from tests.engine.engine_support import BLOCK_BYTES_TINY, Faults, engine, run
from tests.engine.spec_support import BASE, N, Bigram, prompt, spec


# -- config ------------------------------------------------------------------------------------
def test_config_names_defaults_and_errors(tiny_model_dir):
    c = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.policy) == (5, 5, "always")
    assert SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_max": 4}).prompt_lookup_min == 4
    assert SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 2}).prompt_lookup_max == 2
    assert SpeculativeConfig.parse(None) is None
    for bad in ({"method": "eagle"}, {"num_speculative_tokens": 2}, {"method": "ngram", "num_speculative_tokens": 0},
                {"method": "ngram", "num_speculative_tokens": True}, {"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
                {"method": "ngram", "prompt_lookup_min": 0}, {"method": "ngram", "policy": "sometimes"},
                {"method": "ngram", "num_speculative_token": 2}, "ngram"):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)
    with pytest.raises(ValueError):
        EngineConfig(model="x", speculative_config={"method": "ngram", "num_speculative_tokens": -1})
    assert EngineConfig(model="x").speculative_config is None


# -- the n-gram index --------------------------------------------------------------------------
def test_ngram_index_equals_the_scan_as_tokens_grow():
    rng = random.Random(7)
    for _ in range(60):
        lo = rng.randint(1, 3)
        hi = lo + rng.randint(0, 3)
        k = rng.randint(1, 6)
        tokens = [rng.randrange(6) for _ in range(rng.randint(0, 8))]
        index = NgramIndex(lo, hi)
        for _ in range(40):
            assert index.propose(tokens, k) == propose(tokens, k, lo, hi), (tokens, k, lo, hi)
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 3))]


def test_ngram_prefers_longest_then_latest_and_repeats_a_period():
    assert propose([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [9, 2]  # "1 2 3" beats the later "2 3"
    assert propose([5, 1, 8, 1, 9, 1], 1, 1, 1) == [9]  # the latest "1"
    assert propose([4, 7, 7, 7], 5, 1, 2) == [7, 7, 7, 7, 7]  # period 1, continued
    assert propose([1, 2, 3], 3, 2, 2) == []


# -- the verification sampler ------------------------------------------------------------------
def _seqs(params: SamplingParams, count: int, context: list[int]) -> list[Sequence]:
    out = []
    for i in range(count):
        req = Request(f"r{i}", None, list(context), params, 0, i, RequestMetrics(0.0))
        seq = Sequence(req, 0, list(context), len(context))
        req.seqs.append(seq)
        out.append(seq)
    return out


def _chi2(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_verification_is_the_point_mass_rejection_sampler():
    """Known distributions, forced drafts: the first token is distributed as p (so the draft is
    accepted with probability p(d)), the token after an accepted draft as the next row's q, and
    nothing the filters remove (top_k) is ever produced."""
    V, count = 8, 4000
    g = torch.Generator().manual_seed(0)
    l0, l1 = torch.randn(V, generator=g) * 1.5, torch.randn(V, generator=g) * 1.5
    params = SamplingParams(temperature=0.7, top_k=6, max_tokens=8)

    def target(l):
        x = l / 0.7
        kth = torch.sort(x, descending=True).values[5]
        return torch.where(x >= kth, x, torch.tensor(float("-inf"))).softmax(-1).tolist()

    p, q = target(l0), target(l1)
    d = max(range(V), key=lambda t: p[t] if p[t] < 0.5 else -1)  # a likely but not certain draft
    seqs = _seqs(params, count, [1, 2, 3])
    logits = torch.stack([l0, l1, l1] * count)
    tokens, _ = verify(logits, seqs, [3 * i for i in range(count)], [[d, 0]] * count, set(), torch.Generator().manual_seed(1))
    first = [t[0] for t in tokens]
    assert all(len(t) == 1 or (t[0] == d and len(t) >= 2) for t in tokens)  # a rejection ends the run
    counts = [first.count(v) for v in range(V)]
    assert _chi2(counts, p) < 24.3, (counts, p)  # df 7 (at most), alpha 0.001
    assert all(c == 0 for c, pv in zip(counts, p) if pv == 0)
    second = [t[1] for t in tokens if t[0] == d]
    assert abs(len(second) / count - p[d]) < 4 * math.sqrt(p[d] * (1 - p[d]) / count)
    c2 = [second.count(v) for v in range(V)]
    assert _chi2(c2, q) < 24.3, (c2, q)
    # a draft the target gives no mass is never accepted; greedy is the longest argmax prefix
    banned = next(v for v in range(V) if p[v] == 0)
    tokens, _ = verify(logits[:30], seqs[:10], [3 * i for i in range(10)], [[banned, 0]] * 10, set(), torch.Generator().manual_seed(2))
    assert all(len(t) == 1 and t[0] != banned for t in tokens)
    gseqs = _seqs(SamplingParams(temperature=0, max_tokens=8), 2, [1])
    a0, a1 = int(l0.argmax()), int(l1.argmax())
    other = (a1 + 1) % V
    tokens, lps = verify(logits[:6], gseqs, [0, 3], [[a0, a1], [a0, other]], set(), torch.Generator())
    assert tokens == [[a0, a1, a1], [a0, a1]]


def test_seeded_rows_draw_the_same_noise_with_and_without_drafts():
    """A seeded sequence draws one vocabulary row of noise per output token whatever its draft:
    sampling position by position with drafts gives the tokens plain sampling gives."""
    V = 16
    g = torch.Generator().manual_seed(3)
    table = torch.randn(V, V, generator=g) * 2
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=50)
    (plain,) = _seqs(params, 1, [0])
    plain.generator = torch.Generator().manual_seed(11)
    for _ in range(30):  # plain decoding of the bigram table
        tokens, _ = verify(table[plain.token_ids[-1]][None], [plain], [0], [[]], set(), torch.Generator())
        plain.token_ids += tokens[0]
    ref = plain.output_token_ids
    (spec_seq,) = _seqs(params, 1, [0])
    spec_seq.generator = torch.Generator().manual_seed(11)
    rng = random.Random(0)
    while spec_seq.num_output_tokens < 30:
        draft = [rng.choice([ref[spec_seq.num_output_tokens + j] if spec_seq.num_output_tokens + j < 30 else 0, rng.randrange(V)]) for j in range(3)]
        ctx = spec_seq.token_ids + draft
        rows = torch.stack([table[t] for t in ctx[len(spec_seq.token_ids) - 1 :]])
        tokens, _ = verify(rows, [spec_seq], [0], [draft], set(), torch.Generator())
        spec_seq.token_ids += tokens[0]
    assert spec_seq.output_token_ids[:30] == ref


# -- the engine, speculation on against off ----------------------------------------------------
def _requests(tok, seed: int, count: int = 8):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = rng.choice(["greedy", "greedy", "seeded", "penalty", "stop_id", "stop_str", "min_tokens", "logprobs", "fork"])
        kw = dict(max_tokens=rng.randint(6, 40), ignore_eos=True)
        if kind == "greedy":
            p = SamplingParams(temperature=0, **kw)
        elif kind == "seeded":
            p = SamplingParams(temperature=rng.choice([0.5, 1.0]), top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([0, 5]), seed=rng.randrange(99), **kw)
        elif kind == "penalty":
            p = SamplingParams(temperature=rng.choice([0, 0.8]), seed=5, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, **kw)
        elif kind == "stop_id":
            p = SamplingParams(temperature=0, stop_token_ids=[BASE + rng.randrange(N)], **kw)
        elif kind == "stop_str":
            p = SamplingParams(temperature=0, stop=[tok.decode([BASE + rng.randrange(N)]).strip() or "a"], include_stop_str_in_output=rng.random() < 0.5, **kw)
        elif kind == "min_tokens":
            p = SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[BASE + rng.randrange(N)], **kw)
        elif kind == "logprobs":
            p = SamplingParams(temperature=rng.choice([0, 1.0]), seed=7, logprobs=2, **kw)
        else:
            p = SamplingParams(n=rng.choice([2, 3]), temperature=rng.choice([0, 1.0]), seed=9, **kw)
        out.append((f"r{i}", prompt(rng, rng.randint(4, 40)), p))
    return out


def _outcome(req):
    return [(s.output_token_ids, s.detokenizer.text, s.finish_reason, s.stop_reason,
             None if s.logprobs is None else [{k: (round(v.logprob, 4), v.rank) for k, v in lp.items()} for lp in s.logprobs])
            for s in sorted(req.seqs, key=lambda s: s.index)]


def _run(tiny_model_dir, requests, speculative_config, **kw):
    e = engine(tiny_model_dir, speculative_config=speculative_config, **kw)
    Bigram(e)
    for rid, p, params in requests:
        e.add_request(rid, p, params)
    done = run(e)
    stats = e.stats()
    assert stats["kv_blocks_used"] == 0 and stats["cpu_swap_blocks_used"] == 0, stats
    assert all(b.ref_count == 0 for b in e.kv.pool.blocks)
    return {rid: _outcome(r) for rid, r in done.items()}, stats


POOLS = {
    "roomy": dict(),
    # 24 blocks of 4 tokens: any request fits alone (prompt <= 40 + 40 new), ten at once do not
    "swap": dict(block_size=4, kv_cache_memory=24 * BLOCK_BYTES_TINY // 4, swap_space=40 * BLOCK_BYTES_TINY),
    "recompute": dict(block_size=4, kv_cache_memory=24 * BLOCK_BYTES_TINY // 4, swap_space=0),
    "small_budget": dict(max_num_batched_tokens=12, block_size=4, kv_cache_memory=256 * BLOCK_BYTES_TINY // 4),
}


@pytest.mark.parametrize("pool", list(POOLS))
def test_outputs_equal_speculation_off(tiny_model_dir, pool):
    e = engine(tiny_model_dir)
    requests = _requests(e.tokenizer, seed=sum(map(ord, pool)), count=10)
    off, off_stats = _run(tiny_model_dir, requests, None, **POOLS[pool])
    on, stats = _run(tiny_model_dir, requests, spec(k=random.Random(pool).randint(2, 5)), **POOLS[pool])
    assert on == off
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"], stats
    if pool in ("swap", "recompute"):
        assert stats["preemptions_swap"] + stats["preemptions_recompute"] > 0, stats
    else:  # no prompt recomputed: the same prompt tokens
        assert stats["prompt_tokens_computed"] == off_stats["prompt_tokens_computed"], (stats, off_stats)


def test_drafts_on_a_prompts_last_token_are_not_counted_as_prompt_tokens(tiny_model_dir):
    """Chunked prefill leaves a prompt's last token to a chunk of its own, which the speculator
    drafts after (it looks like a decode): those drafts are not prompt tokens (helper-59: the
    /metrics prompt-token counter read 28 for a 23-token prompt)."""
    p = [BASE + t for t in [1, 2, 3, 4, 5] * 4 + [1, 2, 3]]
    requests = [("a", p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]
    for config in (None, spec(k=4)):
        _, stats = _run(tiny_model_dir, requests, config, max_num_batched_tokens=len(p) - 1)
        assert stats["prompt_tokens_computed"] == len(p), stats
    assert stats["spec_decode_num_draft_tokens"] > 0, stats


def test_auto_policy_outputs_equal_and_stats(tiny_model_dir):
    e = engine(tiny_model_dir)
    requests = _requests(e.tokenizer, seed=3, count=6)
    off, _ = _run(tiny_model_dir, requests, None)
    on, stats = _run(tiny_model_dir, requests, spec(k=4, policy="auto"))
    assert on == off
    for key in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                "spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length", "spec_decode_auto_explorations"):
        assert key in stats


def test_a_stop_inside_an_accepted_run_cuts_it(tiny_model_dir):
    """The bigram cycles, so late in the output whole drafts are accepted; a stop string held off
    by ``min_tokens`` (which, for strings, changes no logits) until then must end the output
    inside such a run, exactly where it does without speculation."""
    rng = random.Random(1)
    p = prompt(rng, 20)
    free = engine(tiny_model_dir)
    Bigram(free)
    free.add_request("x", p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    ref = run(free)["x"].seqs[0].output_token_ids
    tok = free.tokenizer
    word = next(w for t in ref[30:45] if (w := tok.decode([t]).strip()).isalnum())
    params = SamplingParams(temperature=0, max_tokens=60, min_tokens=30, stop=[word], ignore_eos=True)
    free = engine(tiny_model_dir)
    Bigram(free)
    free.add_request("x", p, params)
    want = run(free)["x"].seqs[0]
    assert want.finish_reason == "stop" and want.num_output_tokens < 60
    e = engine(tiny_model_dir, speculative_config=spec(k=6))
    Bigram(e)
    steps = []
    real = e._update

    def spy(order, sampling, drafts, tokens, logprobs):
        steps.append([len(t) for t in tokens])
        return real(order, sampling, drafts, tokens, logprobs)

    e._update = spy
    e.add_request("x", p, params)
    got = run(e)["x"].seqs[0]
    assert (got.output_token_ids, got.detokenizer.text, got.finish_reason, got.stop_reason) == (
        want.output_token_ids, want.detokenizer.text, want.finish_reason, want.stop_reason)
    # the last step verified more tokens than were kept: the stop cut an accepted run
    assert sum(sum(s) for s in steps) > got.num_output_tokens, steps


def test_rejected_draft_blocks_are_released_and_never_hashed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = Request("r", None, [1, 2, 3, 4, 5, 6], SamplingParams(), 0, 0, RequestMetrics(0.0))
    seq = Sequence(req, 0, [1, 2, 3, 4, 5, 6], 6)
    assert kv.allocate_slots(seq, 6)
    seq.num_computed_tokens = 6
    seq.token_ids.append(7)  # sampled; now verify it with a 6-token draft: 7 slots over 3 blocks
    assert kv.allocate_slots(seq, 7)
    assert len(seq.block_table) == 4 and kv.pool.num_free == 4
    assert [b.block_hash is not None for b in seq.block_table] == [True, False, False, False]
    seq.num_computed_tokens += 1 + 1  # one draft accepted: 8 computed, a full second block
    seq.token_ids += [8, 9]
    assert kv.trim(seq) == 2 and len(seq.block_table) == 2 and kv.pool.num_free == 6
    assert seq.block_table[1].block_hash is None  # registered only when next scheduled
    assert kv.allocate_slots(seq, 1)
    assert seq.block_table[1].block_hash == seq.full_block_hashes(4, 2)[1]
    kv.free(seq)
    assert kv.pool.num_free == 8


def test_failed_verification_step_recovers_with_the_same_outputs(tiny_model_dir):
    e = engine(tiny_model_dir)
    requests = _requests(e.tokenizer, seed=11, count=6)
    off, _ = _run(tiny_model_dir, requests, None)
    e = engine(tiny_model_dir, speculative_config=spec(k=3))
    Bigram(e)
    faults = Faults(e, lambda b: any(c.num_draft for c in b.chunks), times=2)
    for rid, p, params in requests:
        e.add_request(rid, p, params)
    done = run(e)
    assert faults.raised == 2
    got = {rid: _outcome(r) for rid, r in done.items() if r.error_code is None}
    assert got and all(got[rid] == off[rid] for rid in got)
    assert e.stats()["kv_blocks_used"] == 0


def test_structured_output_with_speculation(tiny_model_dir):
    from qworker.engine.structured import StructuredOutputsParams

    tok = engine(tiny_model_dir).tokenizer
    words = sorted({tok.decode([BASE + i]) for i in range(N)} - {""})[:6]
    choice = StructuredOutputsParams(regex="(" + "|".join(__import__("re").escape(w) for w in words) + "){4,30}")
    rng = random.Random(5)
    requests = [(f"s{i}", prompt(rng, 20), SamplingParams(temperature=t, seed=3, max_tokens=30, structured_outputs=choice))
                for i, t in enumerate([0, 0, 1.0])]
    off, _ = _run(tiny_model_dir, requests, None)
    on, stats = _run(tiny_model_dir, requests, spec(k=4))
    assert on == off
    assert all(o[0][2] in ("stop", "length") for o in on.values())


def test_async_stream_carries_several_tokens_per_delta(tiny_model_dir):
    from qworker.engine.async_engine import AsyncEngine

    e = engine(tiny_model_dir, speculative_config=spec(k=5))
    Bigram(e)
    ae = AsyncEngine(e)
    p = prompt(random.Random(2), 20)

    async def go():
        await ae.start()
        deltas = []
        try:
            async for out in ae.generate("a", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)):
                deltas.append(out.outputs[0].token_ids if out.outputs else [])
        finally:
            await ae.shutdown()
        return deltas

    deltas = asyncio.run(go())
    free = engine(tiny_model_dir)
    Bigram(free)
    free.add_request("a", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert [t for d in deltas for t in d] == run(free)["a"].seqs[0].output_token_ids
    assert max(len(d) for d in deltas) > 1


# -- the auto policy ---------------------------------------------------------------------------
def test_cost_model_interpolates_and_is_pessimistic_past_the_data():
    m = CostModel()
    assert m.estimate(4) is None
    m.observe(1, 0.040)
    m.observe(16, 0.050)
    assert m.estimate(1) == pytest.approx(0.040) and m.estimate(8) == pytest.approx(0.040 + 0.010 * 7 / 15)
    assert m.estimate(32) == pytest.approx(0.100) and m.estimate(32, optimistic=True) == pytest.approx(0.050)


def test_auto_drafts_where_rows_are_cheap_and_not_where_they_cost():
    flat = AutoPolicy(k=4, explore_every=1)
    for rows in list(range(1, 40)) * 2:  # twice: a baseline is trusted once measured min_samples times
        flat.observe_step(rows, 0.040)  # a memory-bound device: rows are free
    for _ in range(50):
        flat.observe_draft(4, 3)
    assert flat.choose_cap(1, [4]) == 4
    linear = AutoPolicy(k=4, explore_every=1)
    for rows in range(1, 400):
        linear.observe_step(rows, 0.001 * rows)  # compute-bound: time per row
    for _ in range(50):
        linear.observe_draft(4, 3)
    assert linear.choose_cap(64, [4] * 64) == 0
    low = AutoPolicy(k=4, explore_every=1)
    for rows in range(1, 40):
        low.observe_step(rows, 0.040 + 0.004 * rows)
    for _ in range(200):
        low.observe_draft(4, 0)  # nothing is ever accepted
    assert low.choose_cap(4, [4] * 4) == 0


def test_auto_explores_an_unmeasured_size_only_now_and_then():
    pol = AutoPolicy(k=4, explore_every=5)
    pol.observe_step(1, 0.040)
    for _ in range(20):
        pol.observe_draft(4, 4)
    caps = [pol.choose_cap(1, [4]) for _ in range(10)]
    assert 0 < sum(c > 0 for c in caps) <= 3  # explores, then waits
