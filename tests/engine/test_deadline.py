"""Deadlines: a request whose deadline passes before it is first scheduled finishes without
running ("abort", error_code "deadline_exceeded"); once started it runs to completion."""

from __future__ import annotations

import asyncio
import time

from qworker import AsyncEngine
from qworker.engine import EngineConfig, LLMEngine, SamplingParams, llm_engine
from tests.engine.engine_support import EngineClock


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def engine(tiny_model_dir, **kw):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=4 << 20, **kw))


def run(e):
    done = {}
    for _ in range(500):
        if not e.has_unfinished():
            break
        done.update((r.request_id, r) for r in e.step() if r.finished)
    return done


def test_expired_before_start_finishes_without_running(tiny_model_dir):
    e = engine(tiny_model_dir)
    e.add_request("late", [5, 6, 7], greedy(4), deadline=time.time() - 1)
    e.add_request("none", [5, 6, 7], greedy(4), deadline=None)
    done = run(e)
    late, ok = done["late"], done["none"]
    assert late.error_code == "deadline_exceeded" and late.error
    assert [s.finish_reason for s in late.seqs] == ["abort"] and late.seqs[0].output_token_ids == []
    assert late.metrics.first_scheduled_time is None and late.metrics.finished_time is not None
    assert ok.error_code is None and len(ok.seqs[0].output_token_ids) == 4
    stats = e.stats()
    assert stats["requests_expired"] == 1 and stats["requests_aborted"] == 0 and stats["kv_blocks_used"] == 0


def test_deadline_passing_while_queued_expires_it_but_not_a_started_one(tiny_model_dir, monkeypatch):
    clock = EngineClock()  # the engine's clock is moved past the deadlines: no race with the machine's speed
    monkeypatch.setattr(llm_engine, "time", clock)
    e = engine(tiny_model_dir, max_num_seqs=1)
    e.add_request("first", [5, 6, 7], greedy(20), deadline=time.time() + 60)
    e.step()  # "first" starts: from now on its deadline no longer applies
    e.add_request("queued", [8, 9], greedy(3), deadline=time.time() + 60)
    e.step()
    assert e.requests["queued"].seqs[0].status.value == "waiting"
    clock.offset = 120.0
    done = run(e)
    assert done["queued"].error_code == "deadline_exceeded" and done["queued"].seqs[0].output_token_ids == []
    assert done["first"].error_code is None and len(done["first"].seqs[0].output_token_ids) == 20


async def test_async_generate_deadline(tiny_model_dir):
    eng = AsyncEngine.from_model(str(tiny_model_dir), kv_cache_memory=4 << 20)
    await eng.start()
    try:
        outs = [o async for o in eng.generate("x", [5, 6, 7], greedy(3), deadline=time.time() - 0.01)]
        assert len(outs) == 1 and outs[0].finished and outs[0].error_code == "deadline_exceeded"
        assert outs[0].outputs[0].finish_reason == "abort" and outs[0].outputs[0].token_ids == []
        outs = [o async for o in eng.generate("y", [5, 6, 7], greedy(3), 0, deadline=time.time() + 60)]
        assert outs[-1].error_code is None and sum(len(c.token_ids) for o in outs for c in o.outputs) == 3
    finally:
        await eng.shutdown()
