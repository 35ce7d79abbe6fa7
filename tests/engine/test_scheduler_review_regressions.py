"""Regressions from helper-44's attack on the engine's feature interactions (2026-12-06).

1. A sequence that held the whole KV pool could never be swapped back in: the swap-in always kept
   one block more for the next token, which a partial last block does not need.
2. A sampler that failed after drawing (the logprobs part, a verification's later positions) left
   seeded requests' generators advanced, so the redone step drew other tokens.
3. A speculative draft took the token budget (and then blocks) that a running prefill behind it
   needed, which got that prefill preempted later.
"""

from __future__ import annotations

import pytest

import qworker.engine.llm_engine as llm_engine
import qworker.engine.spec_decode.verify as verify
from qworker.engine import SamplingParams
from tests.engine.engine_support import BLOCK_BYTES_TINY, engine, greedy, outputs, run

NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def _force_drafts(e, request_id: str, draft: list[int]) -> None:
    """``request_id`` proposes ``draft`` whenever it decodes (a proposal the n-gram lookup makes
    whenever a suffix repeats; every proposal is verified, so any one is legal)."""
    e.speculator.propose = lambda running: {
        s.seq_id: list(draft) for s in running
        if s.request.request_id == request_id and s.num_computed_tokens == len(s.token_ids) - 1} or None


@pytest.mark.parametrize("prompt_len", [48, 50, 63])
def test_a_fork_that_held_the_whole_pool_swaps_back_in(tiny_model_dir, prompt_len):
    # 4 blocks of 16 and a context of 64: the n = 2 prompt fills the pool, the parent's first
    # copy-on-write finds no block and swaps the child out; once the parent is done, the child
    # must come back to the same 4 blocks (and the request queued behind it must run)
    e = engine(tiny_model_dir, kv_cache_memory=4 * BLOCK_BYTES_TINY, swap_space=8 * BLOCK_BYTES_TINY, max_model_len=64)
    free = e.kv.pool.num_free
    e.add_request("a", list(range(1000, 1000 + prompt_len)),
                  SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=64 - prompt_len, ignore_eos=True))
    e.add_request("b", [7, 8, 9], greedy(3))
    done = run(e, max_steps=400)
    assert [len(t) for t in outputs(done["a"])] == [64 - prompt_len] * 2
    assert len(outputs(done["b"])[0]) == 3
    assert e.kv.pool.num_free == free


def _seeded_outputs(tiny_model_dir, fail_on_call: int, target, spec: bool):
    """Two seeded requests; ``target``'s ``sample`` raises once, on call ``fail_on_call``, after
    the real sampler has drawn (0: never)."""
    kw = {"speculative_config": NGRAM} if spec else {}
    e = engine(tiny_model_dir, **kw)
    if spec:
        _force_drafts(e, "r0", [5, 6, 7])
    real = target.sample
    calls = [0]

    def sample(*args, **kwargs):
        result = real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == fail_on_call:
            raise RuntimeError("out of memory in the sampler (injected after drawing)")
        return result

    target.sample = sample
    try:
        for i, prompt in enumerate([list(range(2000, 2011)), list(range(3000, 3017))]):
            e.add_request(f"r{i}", prompt, SamplingParams(temperature=1.0, seed=42 + i, max_tokens=6, ignore_eos=True, logprobs=1))
        done = run(e)
    finally:
        target.sample = real
    assert all(r.error_code is None for r in done.values())
    return {k: outputs(r) for k, r in done.items()}, e.counters["steps_failed"]


@pytest.mark.parametrize("spec", [False, True], ids=["sample", "verify"])
def test_a_sampler_failure_after_drawing_keeps_seeded_tokens(tiny_model_dir, spec):
    target = verify if spec else llm_engine
    clean, failed = _seeded_outputs(tiny_model_dir, 0, target, spec)
    assert failed == 0
    got, failed = _seeded_outputs(tiny_model_dir, 3, target, spec)
    assert failed == 1  # the fault happened and the step was redone
    assert got == clean


def test_a_draft_never_takes_a_running_prefills_tokens_or_blocks(tiny_model_dir):
    # 16 blocks of 4 tokens and 16 tokens a step: A decodes with 8-token drafts (always rejected)
    # while B's 44-token prompt is prefilled in chunks behind it. Drafts that took B's chunk
    # budget slowed B down until both needed the last free block and B was recomputed.
    budget = 16

    def go(spec: bool):
        kw = {"speculative_config": NGRAM} if spec else {}
        e = engine(tiny_model_dir, block_size=4, kv_cache_memory=4 * BLOCK_BYTES_TINY, max_num_batched_tokens=budget,
                   max_model_len=64, **kw)
        if spec:
            _force_drafts(e, "A", [7] * 8)
        a = e.add_request("A", list(range(1000, 1010)), greedy(30))
        e.step()
        b = e.add_request("B", list(range(3000, 3044)), greedy(2))
        chunks = []  # (B's pending tokens, B's tokens this step) for steps B entered running
        schedule = e.scheduler.schedule

        def recording(*args):
            seq = b.seqs[0]
            was_running, pending = seq in e.scheduler.running, len(seq.token_ids) - seq.num_computed_tokens
            out = schedule(*args)
            if was_running:
                chunks.append((pending, sum(s.num_new_tokens for s in out.scheduled if s.seq is seq)))
            return out

        e.scheduler.schedule = recording
        run(e)
        return outputs(a), outputs(b), a.metrics.num_preemptions + b.metrics.num_preemptions, chunks, e.stats()

    plain, drafted = go(False), go(True)
    assert drafted[:2] == plain[:2]
    assert drafted[2] == plain[2] == 0
    assert drafted[4]["spec_decode_num_draft_tokens"] > 0  # A did draft
    # once running, B got its whole chunk every step: all it had left, or the budget but A's token
    assert drafted[3] and all(got == min(pending, budget - 1) for pending, got in drafted[3])
