"""Regressions for the engine defects of issue 11 (one test per defect, named after it), on the
tiny random-weight Llama. Forward failures are injected by wrapping ``runner.execute``."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from qworker import AsyncEngine, InvalidRequestError
from qworker.engine import SamplingParams
from qworker.engine.block_pool import NONE_HASH, hash_block
from qworker.engine.kv_cache_manager import BlockCopies
from qworker.engine.outputs import RequestMetrics
from qworker.engine.sampler import sample
from qworker.engine.scheduler import SchedulerOutput
from qworker.engine.sequence import Request, SeqStatus, Sequence
from tests.engine.engine_support import BLOCK_BYTES_TINY, Faults, dirty, engine, greedy, outputs, rand_ids, run















def solo(tiny_model_dir, prompt, params):
    e = engine(tiny_model_dir, enable_prefix_caching=False)
    e.add_request("solo", prompt, params)
    return outputs(run(e)["solo"])




# 1 ------------------------------------------------------------------------------------------------
def test_1_failed_step_leaves_nothing_unwritten_in_the_prefix_cache(tiny_model_dir):
    rng = random.Random(11)
    shared = rand_ids(rng, 32)  # two full blocks
    a, b = shared + rand_ids(rng, 3), shared + rand_ids(rng, 5)
    want = solo(tiny_model_dir, b, greedy(8))
    e = dirty(engine(tiny_model_dir))
    faults = Faults(e, lambda batch: True, times=2)
    e.add_request("a", a, greedy(8))
    assert e.step() == [], "a lone request's first failed step is retried"
    (failed,) = e.step()
    assert faults.raised == 2 and failed.finished and failed.error_code == "engine_error"
    assert e.stats()["kv_blocks_used"] == 0
    e.add_request("b", b, greedy(8))
    got = run(e)["b"]
    assert outputs(got) == want
    assert got.num_cached_tokens == 0, "b hit blocks whose KV was never written"


# 2 ------------------------------------------------------------------------------------------------
def test_2_out_of_vocab_stop_token_is_rejected_and_cannot_crash_the_sampler(tiny_model_dir):
    e = engine(tiny_model_dir)
    bad = SamplingParams(min_tokens=2, stop_token_ids=[e.vocab_size], max_tokens=4)
    with pytest.raises(InvalidRequestError) as err:
        e.add_request("x", [5, 6, 7], bad)
    assert err.value.code == "invalid_sampling"
    with pytest.raises(InvalidRequestError):
        e.check([5, 6, 7], SamplingParams(stop_token_ids=[2**31 - 1]))
    # defence in depth: the sampler skips ids it cannot index instead of raising for the batch
    req = Request("x", None, [5], bad, 0, 0, RequestMetrics(0.0))
    seq = Sequence(request=req, index=0, token_ids=[5], num_prompt_tokens=1)
    ids, _ = sample(torch.randn(1, e.vocab_size), [seq], {2}, torch.Generator())
    assert 0 <= ids[0] < e.vocab_size and ids[0] != 2


def test_2_a_request_that_breaks_every_step_fails_alone(tiny_model_dir):
    rng = random.Random(12)
    poison_token = 777
    prompts = {f"r{i}": rand_ids(rng, rng.randrange(5, 40)) for i in range(5)}
    prompts["poison"] = rand_ids(rng, 10) + [poison_token] + rand_ids(rng, 4)
    params = {rid: SamplingParams(n=2 if rid == "r1" else 1, temperature=0.8, seed=i, max_tokens=10, ignore_eos=True) for i, rid in enumerate(prompts)}
    e = dirty(engine(tiny_model_dir))
    faults = Faults(e, lambda batch: any(poison_token in c.token_ids for c in batch.chunks), times=10**9)
    for rid, p in prompts.items():
        e.add_request(rid, p, params[rid])
    done = run(e)
    assert faults.raised == 3, "once with everyone, twice alone"
    assert done["poison"].error_code == "engine_error" and done["poison"].seqs[0].finish_reason == "abort"
    for rid in prompts:
        if rid != "poison":
            assert done[rid].error is None and outputs(done[rid]) == solo(tiny_model_dir, prompts[rid], params[rid]), rid
    assert e.stats()["kv_blocks_used"] == 0 and e.stats()["requests_failed"] == 1


def test_2_a_transient_failure_mid_decode_costs_no_request(tiny_model_dir):
    rng = random.Random(13)
    prompts = {f"r{i}": rand_ids(rng, rng.randrange(5, 40)) for i in range(4)}
    e = dirty(engine(tiny_model_dir))
    faults = Faults(e, lambda batch: e.counters["steps"] == 4)
    for rid, p in prompts.items():
        e.add_request(rid, p, greedy(12))
    done = run(e)
    assert faults.raised == 1 and e.stats()["steps_failed"] == 1
    for rid, p in prompts.items():
        assert done[rid].error is None and outputs(done[rid]) == solo(tiny_model_dir, p, greedy(12)), rid


def test_2_a_one_off_failure_of_a_lone_request_costs_it_nothing(tiny_model_dir):
    """A step of one request that fails once (an allocation failing under load) is recomputed
    alone: the request ends as it would have without the failure, at any point of its run."""
    rng = random.Random(14)
    prompt = rand_ids(rng, 40)
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=12, ignore_eos=True)
    want = solo(tiny_model_dir, prompt, params)
    for fail_at in (0, 1, 6):
        e = dirty(engine(tiny_model_dir, max_num_batched_tokens=32))  # two prefill chunks
        faults = Faults(e, lambda batch: e.counters["steps"] == fail_at)
        e.add_request("a", prompt, params)
        got = run(e)["a"]
        assert faults.raised == 1 and e.stats()["requests_failed"] == 0, fail_at
        assert got.error is None and outputs(got) == want, fail_at
        assert e.stats()["kv_blocks_used"] == 0


# 3 ------------------------------------------------------------------------------------------------
async def test_3_stream_gets_a_delta_after_a_failed_step(tiny_model_dir):
    eng = AsyncEngine.from_model(str(tiny_model_dir), kv_cache_memory=64 * BLOCK_BYTES_TINY)
    faults = Faults(eng.engine, lambda batch: eng.engine.counters["steps"] >= 5, times=2)
    await eng.start()
    try:
        deltas = [d async for d in eng.generate("a", [5, 6, 7, 8], greedy(50))]
    finally:
        await eng.shutdown()
    assert faults.raised == 2
    last = deltas[-1]
    assert last.finished and last.error_code == "engine_error" and last.outputs[0].finish_reason == "abort"
    streamed = [t for d in deltas for c in d.outputs for t in c.token_ids]
    assert len(streamed) == 5 and last.outputs[0].token_ids == [], "the last item is a delta"


# 4 ------------------------------------------------------------------------------------------------
def test_4_recomputed_request_longer_than_a_step_still_runs_without_chunked_prefill(tiny_model_dir):
    rng = random.Random(14)
    # 8 blocks of 4 tokens; b is preempted (recompute, no prefix hits) at 21 tokens > 16 per step
    e = engine(tiny_model_dir, block_size=4, kv_cache_memory=8 * 2 * 2 * 4 * 2 * 16 * 4, swap_space=0,
               max_num_batched_tokens=16, enable_chunked_prefill=False, enable_prefix_caching=False)
    prompts = {"a": rand_ids(rng, 4), "b": rand_ids(rng, 14)}
    for rid, p in prompts.items():
        e.add_request(rid, p, greedy(16))
    done = run(e, max_steps=300)
    assert e.stats()["preemptions_recompute"] > 0
    for rid, p in prompts.items():
        assert outputs(done[rid]) == solo(tiny_model_dir, p, greedy(16))


# 5, 6 -------------------------------------------------------------------------------------------
def _first_token_text(e, prompt):
    free = run_one(e, prompt, greedy(12))
    return free, e.tokenizer.decode(free.token_ids[:1])


def run_one(e, prompt, params):
    rid = f"q{time.monotonic_ns()}"
    e.add_request(rid, prompt, params)
    req = run(e)[rid]
    from qworker.engine.output_processor import final_output

    return final_output(req).outputs[0]


def test_5_stop_strings_wait_for_min_tokens(tiny_model_dir):
    e = engine(tiny_model_dir)
    rng = random.Random(15)
    while True:
        prompt = rand_ids(rng, 8)
        free, first = _first_token_text(e, prompt)
        if first.strip():
            break
    stop = first.strip()[0]
    early = run_one(e, prompt, greedy(12, stop=[stop]))
    assert early.finish_reason == "stop" and len(early.token_ids) == 1
    gated = run_one(e, prompt, greedy(12, stop=[stop], min_tokens=6))
    assert len(gated.token_ids) >= 6 and gated.token_ids == free.token_ids[: len(gated.token_ids)]


def test_6_stop_token_text_left_out_unless_asked(tiny_model_dir):
    e = engine(tiny_model_dir)
    rng = random.Random(16)
    tok = e.tokenizer
    while True:
        prompt = rand_ids(rng, 9)
        free = run_one(e, prompt, greedy(12))
        stop_tok = free.token_ids[4]
        if tok.decode([stop_tok]).strip():
            break
    out = run_one(e, prompt, greedy(12, stop_token_ids=[stop_tok]))
    assert out.stop_reason == stop_tok and out.token_ids[-1] == stop_tok
    assert out.text == tok.decode(out.token_ids[:-1])
    kept = run_one(e, prompt, greedy(12, stop_token_ids=[stop_tok], include_stop_str_in_output=True))
    assert kept.text == tok.decode(kept.token_ids)
    # include_stop_str_in_output keeps a matched stop string too
    stop = tok.decode(free.token_ids[2:4]).strip()
    cut = run_one(e, prompt, greedy(12, stop=[stop]))
    with_stop = run_one(e, prompt, greedy(12, stop=[stop], include_stop_str_in_output=True))
    assert with_stop.text == cut.text + stop


# 7 ------------------------------------------------------------------------------------------------
def test_7_priority_holds_across_waiting_and_swapped(tiny_model_dir):
    rng = random.Random(17)
    e = engine(tiny_model_dir, kv_cache_memory=12 * BLOCK_BYTES_TINY, swap_space=64 * BLOCK_BYTES_TINY)
    e.add_request("mid", rand_ids(rng, 60), greedy(40), priority=1)
    e.add_request("low", rand_ids(rng, 100), greedy(40), priority=5)
    e.step()
    e.step()
    low = e.requests["low"].seqs[0]
    e.scheduler._preempt(low, SchedulerOutput())  # swapped out; too big to come back next step
    assert low.status is SeqStatus.SWAPPED
    e.add_request("high", rand_ids(rng, 5), greedy(3), priority=-1)
    e.step()
    assert e.requests["high"].seqs[0].num_output_tokens == 1, "high ran at once, with its blocks free"
    done = run(e)
    assert all(len(outputs(r)[0]) == r.params.max_tokens for r in done.values())


# 8 ------------------------------------------------------------------------------------------------
async def test_8_reusing_an_aborted_request_id(tiny_model_dir):
    eng = AsyncEngine.from_model(str(tiny_model_dir), kv_cache_memory=64 * BLOCK_BYTES_TINY)
    await eng.start()
    try:
        for _ in range(3):
            gen = eng.generate("x", [5, 6, 7], greedy(400))
            await gen.__anext__()
            await gen.aclose()  # aborts "x"; the id is free at once
            deltas = [d async for d in eng.generate("x", [9, 10, 11], greedy(6))]
            assert deltas[-1].finished and deltas[-1].error is None
            assert deltas[-1].outputs[0].finish_reason == "length"
            assert sum(len(c.token_ids) for d in deltas for c in d.outputs) == 6
        for _ in range(100):
            if eng.stats()["num_running"] == 0:
                break
            await asyncio.sleep(0.02)
        stats = eng.stats()
        assert stats["requests_aborted"] == 3 and stats["requests_finished"] == 3 and stats["kv_blocks_used"] == 0
    finally:
        await eng.shutdown()


# 9 ------------------------------------------------------------------------------------------------
def test_9_num_cached_tokens_only_from_the_first_admission(tiny_model_dir):
    rng = random.Random(19)
    e = engine(tiny_model_dir, max_num_batched_tokens=16)
    e.add_request("a", rand_ids(rng, 40), greedy(3))
    e.step()  # 16 prompt tokens computed: one full block registered
    seq = e.requests["a"].seqs[0]
    e.scheduler._preempt(seq, SchedulerOutput())  # recompute: readmission hits its own block
    req = run(e)["a"]
    assert req.metrics.num_preemptions == 1 and e.stats()["prefix_cache_hits"] == 16
    assert req.num_cached_tokens == 0


# 10 -----------------------------------------------------------------------------------------------
def test_10_forks_respect_max_num_seqs(tiny_model_dir):
    rng = random.Random(20)
    prompt = rand_ids(rng, 21)
    p = SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    e = engine(tiny_model_dir, max_num_seqs=2)
    e.add_request("fork", prompt, p)
    e.add_request("other", rand_ids(rng, 7), greedy(6))
    done = {}
    while e.has_unfinished():
        done.update((r.request_id, r) for r in e.step() if r.finished)
        assert len(e.scheduler.running) <= 2
    assert outputs(done["fork"]) == solo(tiny_model_dir, prompt, p)


# 11 -----------------------------------------------------------------------------------------------
def test_11_denormal_temperature_is_greedy(tiny_model_dir):
    e = engine(tiny_model_dir)
    prompt = rand_ids(random.Random(21), 9)
    base = run_one(e, prompt, greedy(8)).token_ids
    for t in (1e-45, 1e-8, 9e-6):
        assert run_one(e, prompt, SamplingParams(temperature=t, max_tokens=8, ignore_eos=True)).token_ids == base


# suspected --------------------------------------------------------------------------------------
def test_step_that_schedules_nothing_still_applies_its_block_copies(tiny_model_dir):
    e = engine(tiny_model_dir)
    k0, v0 = e.runner.kv.layers[0]
    k0[3].fill_(1.5)
    e.scheduler.schedule = lambda: SchedulerOutput(copies=BlockCopies(copy=[(3, 4)]))
    assert e.step() == []
    assert torch.equal(k0[4], k0[3])


def test_block_hash_is_a_chained_sha256():
    h = hash_block(NONE_HASH, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 32
    assert hash_block(h, [5, 6, 7, 8]) != hash_block(hash_block(NONE_HASH, [1, 2, 3, 5]), [5, 6, 7, 8])
    assert hash_block(NONE_HASH, [1, 2, 3, 4]) == h


def test_incomplete_character_at_the_end_is_not_dropped(tiny_model_dir):
    e = engine(tiny_model_dir)
    tok = e.tokenizer
    ids = tok.encode("ok 🚀")
    cut = ids[:-1]  # the rocket's bytes, cut short
    assert tok.decode(cut).endswith("\ufffd")
    out = run_one(e, cut[:1], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert out.text == tok.decode(out.token_ids)
    # through the engine's finish: a forced output ending mid-character keeps its U+FFFD
    e.add_request("u", [5, 6], greedy(len(cut) - 1))
    req = e.requests["u"]
    seq = req.seqs[0]
    for t in cut[1:]:
        seq.token_ids.append(t)
        seq.detokenizer.append(t)
    e.abort("u")
    assert seq.detokenizer.text == tok.decode(cut[1:])


def test_detokenizers_do_not_share_the_event_loops_tokenizer(tiny_model_dir):
    e = engine(tiny_model_dir)
    AsyncEngine(e)  # steps on its own thread while the loop encodes with e.tokenizer
    e.add_request("a", [5, 6, 7], greedy(2))
    assert e.requests["a"].seqs[0].detokenizer.tokenizer is not e.tokenizer
    assert outputs(run(e)["a"]) == solo(tiny_model_dir, [5, 6, 7], greedy(2))


@pytest.mark.parametrize("field,value", [("swap_space", 1.5), ("swap_space", 4.0), ("kv_cache_memory", 1e8), ("max_num_seqs", True)])
def test_counts_and_byte_sizes_must_be_whole_numbers(field, value):
    """helper-95: a float swap_space (vLLM's is GiB as a float) crashed the block allocator."""
    from qworker.engine import EngineConfig

    with pytest.raises(ValueError, match=f"{field} must be a whole number"):
        EngineConfig(model="-", **{field: value})


@pytest.mark.parametrize("value", [0, -5])
def test_max_model_len_below_one_is_refused(value):
    """helper-98: -5 crashed in the rope table's arange; 0 silently meant the model's default."""
    from qworker.engine import EngineConfig

    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        EngineConfig(model="-", max_model_len=value)
