"""Continuous batching, chunked prefill, priorities and preemption, step by step (tiny model)."""

from __future__ import annotations

import random

import pytest

from qworker.engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams

BLOCK_BYTES_TINY = 2 * 2 * 16 * 2 * 16 * 4  # layers * (k,v) * block * kv_heads * head_dim * fp32


def engine(tiny_model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 64 * BLOCK_BYTES_TINY)
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), **kw))


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def rand_ids(rng, n):
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_requests_join_and_leave_every_step_and_share_the_forward_pass(tiny_model_dir):
    rng = random.Random()
    e = engine(tiny_model_dir)
    e.add_request("a", rand_ids(rng, 5), greedy(3))
    e.step()  # a: prefill
    e.add_request("b", rand_ids(rng, 9), greedy(6))
    sched = e.scheduler.schedule()
    kinds = sorted(s.num_new_tokens for s in sched.scheduled)
    assert kinds == [1, 9], "a's decode and b's prefill share the step"
    e._run(sched)  # run that step through the engine by hand, then keep stepping
    e.step()  # a's last token: it finishes and leaves
    assert "a" not in e.requests and "b" in e.requests
    assert len(e.scheduler.running) == 1
    while e.has_unfinished():
        e.step()
    assert e.stats()["kv_blocks_used"] == 0


def test_chunked_prefill_interleaves_with_decodes(tiny_model_dir):
    rng = random.Random()
    e = engine(tiny_model_dir, max_num_batched_tokens=16)
    e.add_request("short", rand_ids(rng, 4), greedy(20))
    e.step()
    e.add_request("long", rand_ids(rng, 70), greedy(2))
    steps = []
    while "long" in e.requests:
        counts = {r.request_id: r.seqs[0].num_computed_tokens for r in e.requests.values()}
        e.step()
        steps.append({rid: r.seqs[0].num_computed_tokens - counts[rid] for rid, r in e.requests.items() if rid in counts})
    # the 70-token prompt goes in chunks of 15 next to the short request's decode, never starving it
    assert [s["long"] for s in steps[:4]] == [15, 15, 15, 15]
    assert all(s.get("short") == 1 for s in steps[:4])


def test_priority_orders_admission(tiny_model_dir):
    rng = random.Random()
    e = engine(tiny_model_dir, max_num_seqs=1)
    e.add_request("low", rand_ids(rng, 6), greedy(2), priority=5)
    e.add_request("high", rand_ids(rng, 6), greedy(2), priority=-1)
    e.add_request("mid", rand_ids(rng, 6), greedy(2), priority=0)
    finished = []
    while e.has_unfinished():
        for r in e.step():
            if r.finished:
                finished.append(r.request_id)
    assert finished == ["high", "mid", "low"]


def test_fcfs_runs_in_arrival_order_and_refuses_a_priority(tiny_model_dir):
    rng = random.Random()
    e = engine(tiny_model_dir, max_num_seqs=1, scheduling_policy="fcfs")
    # as vLLM: a priority that FCFS would ignore is refused, not silently dropped
    with pytest.raises(InvalidRequestError, match="scheduling_policy"):
        e.add_request("prio", rand_ids(rng, 6), greedy(2), priority=-9)
    assert not e.requests
    for name in ("first", "second"):
        e.add_request(name, rand_ids(rng, 6), greedy(2), priority=0)
    order = []
    while e.has_unfinished():
        order += [r.request_id for r in e.step() if r.finished]
    assert order == ["first", "second"]


@pytest.mark.parametrize("swap", [True, False])
def test_preemption_takes_the_lowest_priority_and_never_fails_a_request(tiny_model_dir, swap):
    rng = random.Random()
    e = engine(tiny_model_dir, kv_cache_memory=12 * BLOCK_BYTES_TINY, swap_space=(64 * BLOCK_BYTES_TINY) if swap else 0)
    e.add_request("vip", rand_ids(rng, 20), greedy(60), priority=0)
    for i in range(3):
        e.add_request(f"bulk{i}", rand_ids(rng, 20), greedy(60), priority=1)
    done = {}
    for _ in range(2000):
        if not e.has_unfinished():
            break
        for r in e.step():
            if r.finished:
                done[r.request_id] = r
    assert len(done) == 4
    assert all(len(r.seqs[0].output_token_ids) == 60 for r in done.values())
    stats = e.stats()
    mode = "preemptions_swap" if swap else "preemptions_recompute"
    assert stats[mode] > 0, stats
    assert done["vip"].metrics.num_preemptions == 0, "the highest-priority request is never the victim"
    events = [ev for r in done.values() for _, ev, _ in r.metrics.events]
    assert events.count("preempt_swap" if swap else "preempt_recompute") == stats[mode]
    assert events.count("swap_in") == (stats["preemptions_swap"] if swap else 0)
    assert stats["kv_blocks_used"] == 0 and stats["cpu_swap_blocks_used"] == 0


def test_identical_prompts_in_one_step_share_blocks(tiny_model_dir):
    rng = random.Random()
    e = engine(tiny_model_dir)
    prompt = rand_ids(rng, 40)
    for i in range(3):
        e.add_request(f"r{i}", prompt, greedy(2))
    sched = e.scheduler.schedule()
    tables = [[b.block_id for b in s.seq.block_table] for s in sched.scheduled]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2], "the two full blocks are shared"
    assert [s.num_new_tokens for s in sched.scheduled] == [40, 8, 8]
