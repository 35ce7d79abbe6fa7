"""The worker with the real engine and model, in-process, against the real broker."""

from __future__ import annotations

import asyncio
import time

import pytest

from qworker.messages import DLQ_HEADER_ERROR, Job, Sampling
from qworker.worker import Worker
from qworker.worker.client import submit

from .conftest import GREEDY_INPUTS, GREEDY_MAX_TOKENS, Results, stream_text, wait_committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def greedy(jid: str, max_tokens: int = 4, **kw) -> Job:
    return Job(id=jid, sampling=Sampling(max_tokens=max_tokens, temperature=0.0), **kw)


async def test_completion_equals_offline_greedy_and_stream(real_engine, topics, results: Results) -> None:
    eng, refs = real_engine
    w = Worker(topics, eng)
    await w.start()
    try:
        jobs = []
        for name, inp in GREEDY_INPUTS.items():
            key = {"plain": "prompt", "chat": "messages", "ids": "prompt_token_ids"}[name]
            jobs.append(Job.model_validate({"id": f"g-{name}", key: inp, "sampling": {"max_tokens": GREEDY_MAX_TOKENS, "temperature": 0.0}, "stream": True}))
        await submit(topics, jobs)
        await results.wait(lambda: len(results.completions) == len(jobs), 60)
        for name in GREEDY_INPUTS:
            [c] = results.completions[f"g-{name}"]
            assert c["type"] == "completion", c
            ch = c["choices"][0]
            assert ch["token_ids"] == refs[name].token_ids and ch["text"] == refs[name].text
            assert ch["finish_reason"] == refs[name].finish_reason
            assert stream_text(results.deltas[f"g-{name}"], c["run_id"]) == ch["text"]
            assert c["usage"]["completion_tokens"] == len(ch["token_ids"])
            assert c["timings"]["ttft_s"] is not None and c["timings"]["total_s"] >= c["timings"]["ttft_s"]
        await wait_committed(topics)
    finally:
        await w.stop()


async def test_bad_inputs_get_answers_and_worker_keeps_serving(real_engine, topics, results: Results) -> None:
    eng, _ = real_engine
    w = Worker(topics, eng)
    await w.start()
    try:
        await submit(topics, [b"\xff\xfe not json at all", {"id": "schema", "prompt": 5}])
        await submit(topics, [greedy("long", prompt_token_ids=[100] * (eng.max_model_len + 10)), greedy("late", prompt="hi", deadline=time.time() - 5)])
        await submit(topics, [greedy("fine", prompt="Hello")])
        await results.wait(lambda: len(results.completions) == 4 and len(results.dlq) == 1, 60)
        errs = {k: v[0]["error"]["code"] for k, v in results.completions.items() if v[0]["type"] == "error"}
        assert errs == {"schema": "invalid_job", "long": "prompt_too_long", "late": "deadline_exceeded"}
        assert dict(results.dlq[0].headers)[DLQ_HEADER_ERROR] == b"not_json"
        assert results.completions["fine"][0]["type"] == "completion"
        await wait_committed(topics)
    finally:
        await w.stop()


async def test_backpressure_tiny_kv_pool_50_jobs(real_engine, topics, results: Results) -> None:
    eng, _ = real_engine
    s = topics.model_copy(update={"max_waiting_jobs": 4, "admission_reserve_tokens": 8})
    w = Worker(s, eng)
    await w.start()
    peak = {"pending": 0, "running": 0}

    async def watch() -> None:
        while True:
            peak["pending"] = max(peak["pending"], len(w.pending))
            peak["running"] = max(peak["running"], sum(1 for st in w.jobs.values() if st.admitted))
            await asyncio.sleep(0.01)

    t = asyncio.create_task(watch())
    try:
        # ~40 prompt tokens + 4 new each: the ~270-token pool holds only a few at once
        jobs = [greedy(f"bp{i}", prompt=f"Job {i}: " + "please summarise the following sentence briefly. " * 4) for i in range(50)]
        await submit(s, jobs)
        await results.wait(lambda: len(results.completions) == 50, 150, "50 completions")
        assert all(v[0]["type"] == "completion" for v in results.completions.values())
        assert w.stats.pause_events >= 1, "the consumer never paused"
        assert peak["pending"] <= 4  # bounded: the rest stayed in Kafka
        cap = eng.capacity()
        assert peak["running"] <= cap.total_tokens // 40 + 4  # admission followed the KV pool
        await wait_committed(s)
    finally:
        t.cancel()
        await w.stop()
