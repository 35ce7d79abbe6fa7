"""Review of speculative decoding (issue 16): regression tests for defects found by trying to
break it. Each test failed before its fix."""

from __future__ import annotations

import math
import random
import tracemalloc

import pytest

from qworker.engine.spec_decode import AutoPolicy, NgramIndex, SpeculativeConfig, propose
from qworker.model import linear
from tests.engine.engine_support import engine, greedy, rand_ids, run
from tests.engine.spec_support import spec


# -- the auto policy: odd timings ----------------------------------------------------------------
@pytest.mark.parametrize("seconds", [0.0, -0.01, math.nan, math.inf])
def test_auto_never_raises_on_odd_step_timings(seconds):
    """A step timed as 0 s (a coarse clock) made ``choose_cap`` divide by zero; a negative, NaN or
    infinite reading poisoned the cost curve (negative: rows looked free; NaN: never drafts)."""
    for base, verify in ((seconds, 0.05), (0.04, seconds)):
        pol = AutoPolicy(k=4, explore_every=1)
        for _ in range(3):
            pol.observe_step(1, base)
            pol.observe_step(5, verify)
        for _ in range(30):
            pol.observe_draft(4, 1)
        caps = [pol.choose_cap(1, [4]) for _ in range(4)]
        assert all(c in (0, 1, 2, 4) for c in caps)
    if seconds == 0.0:
        return  # a zero reading is a (coarse) measurement: it may say rows are cheap
    pol = AutoPolicy(k=4, explore_every=1)
    pol.observe_step(1, 0.04)
    pol.observe_step(1, 0.04)
    pol.observe_step(5, seconds)
    pol.observe_step(5, seconds)
    pol.observe_step(5, 0.2)  # verifying costs 5x a plain decode: readings that are no time must not hide it
    pol.observe_step(5, 0.2)
    for _ in range(30):
        pol.observe_draft(4, 1)
    assert pol.choose_cap(1, [4]) == 0


def test_auto_recovers_from_a_slow_first_plain_step():
    """The first plain decode (warm-up) took 10 s; every later step then verified drafts, so the
    baseline was never measured again and ``auto`` kept drafting although a verification step cost
    more than the tokens it added (here ~25% slower than not speculating, for good)."""
    def cost(rows):  # compute-bound: each row costs 3/4 of a plain decode step
        return 0.04 + 0.03 * (rows - 1)

    pol = AutoPolicy(k=4)
    pol.observe_step(1, 10.0)
    caps = []
    for step in range(300):
        c = pol.choose_cap(1, [4])
        caps.append(c)
        rows = 1 + c
        pol.observe_step(rows, cost(rows))
        if c:
            pol.observe_draft(c, 1 if step % 10 < 3 else 0)  # 30% of first draft tokens accepted
    assert sum(c > 0 for c in caps[100:]) <= 20, caps[100:]



def test_auto_retries_a_size_whose_first_step_was_slow():
    """The first verification step of a size took 10 s (a kernel compiled for a new shape); the
    optimistic estimate for exploring it read that one sample, so the size was never tried again
    and ``auto`` never drafted, on a device where rows are free and 3 of 4 drafts are accepted."""
    pol = AutoPolicy(k=4)
    pol.observe_step(1, 0.04)
    pol.observe_step(1, 0.04)
    pol.observe_step(5, 10.0)
    for _ in range(50):
        pol.observe_draft(4, 3)
    caps = []
    for _ in range(120):
        c = pol.choose_cap(1, [4])
        caps.append(c)
        pol.observe_step(1 + c, 0.04)
        if c:
            pol.observe_draft(c, min(c, 3))
    assert sum(c == 4 for c in caps[60:]) > 50, caps


# -- the config --------------------------------------------------------------------------------
def test_unknown_keys_of_mixed_types_are_a_value_error():
    """``sorted`` over unknown keys of mixed types (a JSON-less caller's {1: ..., "x": ...}) raised
    TypeError instead of the ValueError naming them."""
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        SpeculativeConfig.parse({"method": "ngram", 1: 2, "x": 3})


# -- the n-gram index --------------------------------------------------------------------------
def test_ngram_index_memory_does_not_grow_with_the_lookup_window():
    """The index held one tuple per token for every n in n_min..n_max: with the allowed window
    1..64, a 4,000-token prompt took ~80 MiB (and ~1.1 s of the engine's step) per sequence on its
    first proposal; a 32k context, gigabytes. Proposals must stay those of the scan."""
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(4000)]
    tracemalloc.start()
    try:
        index = NgramIndex(1, 64)
        index.propose(tokens, 4)
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert used < 8 << 20, used
    for _ in range(25):  # a copying, repetitive context: long and short matches mixed
        k = rng.randint(1, 8)
        assert index.propose(tokens, k) == propose(tokens, k, 1, 64)
        tokens += tokens[rng.randrange(len(tokens) - 8):][: rng.randint(1, 8)] if rng.random() < 0.7 else [rng.randrange(50)]


def test_logprobs_equal_speculation_off_bit_for_bit_on_the_real_forward(tiny_model_dir, monkeypatch):
    """The tiny model's own logits (no bigram table): a verify chunk of 1 + k rows must give each
    row the bits a plain decode row gets, so every logprob equals the one without speculation
    exactly. The start-up GEMM choice must not trade that away for speed (it once picked ``x @ w``
    on this model's shapes, whose kernels depend on the row count: logprobs then differed in the
    last bits, and a near-tie could change a token)."""
    monkeypatch.delenv("QWORKER_CPU_LINEAR", raising=False)
    monkeypatch.setattr(linear, "_choices", {})
    rng = random.Random(5)
    prompts = [[t for _ in range(6) for t in rand_ids(rng, rng.randint(2, 5))] for _ in range(6)]

    def run_all(speculative_config):
        e = engine(tiny_model_dir, speculative_config=speculative_config)
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, greedy(24, logprobs=5))
        done = run(e)
        stats = e.stats()
        return {i: [(s.output_token_ids, [{k: v.logprob for k, v in lp.items()} for lp in s.logprobs]) for s in r.seqs]
                for i, r in done.items()}, stats

    off, _ = run_all(None)
    on, stats = run_all(spec(k=4, lo=2, hi=3))
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert on == off
