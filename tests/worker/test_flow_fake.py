"""The worker's Kafka behaviour against the real broker, with a fake engine (fast, no model)."""

from __future__ import annotations

import asyncio
import time

import pytest

from qworker.messages import DLQ_HEADER_ERROR, DLQ_HEADER_OFFSET, DLQ_HEADER_TOPIC, Job, Sampling
from qworker.worker import Worker
from qworker.worker.client import cancel, submit

from .conftest import Results, committed, stream_text, wait_committed
from .fake_engine import FakeEngine, expected_text

pytestmark = pytest.mark.timeout(120)


async def started(settings, engine=None, **kw) -> Worker:
    if engine is None:
        engine = FakeEngine(**kw)
        await engine.start()
    w = Worker(settings, engine)
    await w.start()
    return w


def job(i: int | str, prompt: str = "hello", max_tokens: int = 5, **kw) -> Job:
    return Job(id=str(i), prompt=prompt, sampling=Sampling(max_tokens=max_tokens, temperature=0.0), **kw)


async def test_completion_stream_and_commit(topics, results: Results) -> None:
    w = await started(topics)
    try:
        jobs = [job(f"j{i}", prompt=f"prompt {i}", max_tokens=12, stream=True, metadata={"n": i}) for i in range(20)]
        await submit(topics, jobs)
        await results.wait(lambda: len(results.completions) == 20, 30)
        for j in jobs:
            [c] = results.completions[j.id]
            assert c["type"] == "completion" and c["status"] == "ok" and c["metadata"] == j.metadata
            text = c["choices"][0]["text"]
            assert text == expected_text([ord(ch) for ch in j.prompt], 12)
            assert c["usage"] == {"prompt_tokens": len(j.prompt), "completion_tokens": 12, "cached_tokens": 0}
            assert c["timings"]["total_s"] >= c["timings"]["ttft_s"] >= 0
            assert stream_text(results.deltas[j.id], c["run_id"]) == text
            assert all(d["attempt"] == c["attempt"] for d in results.deltas[j.id])
        # committed offsets cover every record once their results were acknowledged
        await wait_committed(topics)
    finally:
        await w.stop()


async def test_rejects_and_dlq_then_keeps_serving(topics, results: Results) -> None:
    w = await started(topics, max_model_len=100)
    try:
        await submit(topics, [b"{not json", b'["a"]', b'{"prompt": "no id"}'])
        await submit(topics, [{"id": "bad-schema", "prompt": "x", "sampling": {"max_tokens": "many"}, "metadata": {"k": 1}}])
        await submit(topics, [job("too-long", prompt="x" * 200), job("expired", deadline=time.time() - 1), job("wrong-model", model="gpt-9")])
        await submit(topics, [{"id": "bad-sampling", "prompt": "x", "sampling": {"top_p": 0}}])
        await submit(topics, [job("ok-after", max_tokens=3)])
        await results.wait(lambda: len(results.completions) == 6 and len(results.dlq) == 3, 30)
        codes = {k: v[0]["error"]["code"] for k, v in results.completions.items() if v[0]["type"] == "error"}
        assert codes == {"bad-schema": "invalid_job", "too-long": "prompt_too_long", "expired": "deadline_exceeded", "wrong-model": "wrong_model", "bad-sampling": "invalid_job"}
        assert results.completions["bad-schema"][0]["metadata"] == {"k": 1}
        assert all(v[0]["error"]["retryable"] is False for k, v in results.completions.items() if k in codes)
        assert results.completions["ok-after"][0]["type"] == "completion"
        reasons = sorted(dict(r.headers)[DLQ_HEADER_ERROR].decode() for r in results.dlq)
        assert reasons == ["no_id", "not_json", "not_object"]
        for r in results.dlq:
            h = dict(r.headers)
            assert h[DLQ_HEADER_TOPIC].decode() == topics.jobs_topic and int(h[DLQ_HEADER_OFFSET]) >= 0
        assert {r.value for r in results.dlq} == {b"{not json", b'["a"]', b'{"prompt": "no id"}'}
        await wait_committed(topics)
    finally:
        await w.stop()


async def test_duplicate_in_flight_runs_once(topics, results: Results) -> None:
    eng = FakeEngine(step_s=0.05)
    await eng.start()
    w = await started(topics, eng)
    try:
        # same key -> same partition: the second record arrives while the first is running
        await submit(topics, [job("dup", max_tokens=20)])
        await asyncio.sleep(0.3)
        await submit(topics, [job("dup", max_tokens=20)])
        await results.wait(lambda: "dup" in results.completions, 20)
        await asyncio.sleep(0.5)
        assert len(results.completions["dup"]) == 1
        assert sum(1 for r in eng.started_ids if r.startswith("dup#")) == 1
        assert w.stats.duplicates == 1
        await wait_committed(topics)
    finally:
        await w.stop()


async def test_cancel_in_flight_and_before_arrival(topics, results: Results) -> None:
    eng = FakeEngine(step_s=0.05)
    await eng.start()
    w = await started(topics, eng)
    try:
        await asyncio.sleep(1.0)  # the cancel reader is assigned
        await submit(topics, [job("long", max_tokens=400, stream=True)])
        await results.wait(lambda: "long" in results.deltas, 20)
        await cancel(topics, "long")
        await cancel(topics, "later")  # arrives before its job
        await results.wait(lambda: "long" in results.completions, 20)
        c = results.completions["long"][0]
        assert c["status"] == "cancelled" and c["choices"][0]["finish_reason"] == "cancelled"
        assert 0 < c["usage"]["completion_tokens"] < 400
        await asyncio.sleep(0.3)
        await submit(topics, [job("later")])
        await results.wait(lambda: "later" in results.completions, 20)
        assert results.completions["later"][0]["status"] == "cancelled"
    finally:
        await w.stop()


async def test_backpressure_pauses_and_bounds_memory(topics, results: Results) -> None:
    # KV room for ~2 jobs at a time, 4 queued locally at most
    eng = FakeEngine(step_s=0.01, total_tokens=120)
    await eng.start()
    s = topics.model_copy(update={"max_waiting_jobs": 4, "admission_reserve_tokens": 20})
    w = await started(s, eng)
    peak_pending = 0

    async def watch() -> None:
        nonlocal peak_pending
        while True:
            peak_pending = max(peak_pending, len(w.pending))
            await asyncio.sleep(0.005)

    t = asyncio.create_task(watch())
    try:
        await submit(s, [job(f"bp{i}", prompt="p" * 30, max_tokens=20) for i in range(50)])
        await results.wait(lambda: len(results.completions) == 50, 60)
        assert all(v[0]["type"] == "completion" for v in results.completions.values())
        assert w.stats.pause_events >= 1
        assert peak_pending <= 4
        assert eng.max_running_seen <= 3
    finally:
        t.cancel()
        await w.stop()


async def test_two_workers_rebalance_no_loss(topics, results: Results) -> None:
    w1 = await started(topics, step_s=0.02)
    try:
        await submit(topics, [job(f"a{i}", max_tokens=10) for i in range(30)])
        await asyncio.sleep(0.3)
        w2 = await started(topics, step_s=0.02)  # joins mid-flight: partitions move
        try:
            await submit(topics, [job(f"b{i}", max_tokens=10) for i in range(30)])
            await results.wait(lambda: len(results.completions) == 60, 60)
            deadline = time.monotonic() + 15
            while not (w1.consumer.assignment() and w2.consumer.assignment()):
                assert time.monotonic() < deadline, "the group never split"
                await asyncio.sleep(0.2)
            assert not (w1.consumer.assignment() & w2.consumer.assignment())
        finally:
            await w2.stop()
    finally:
        await w1.stop()


async def test_drain_finishes_in_flight_and_commits(topics, results: Results) -> None:
    w = await started(topics, step_s=0.02)
    await submit(topics, [job(f"d{i}", max_tokens=30) for i in range(6)])
    await results.wait(lambda: len(w.jobs) == 6, 20)
    await w.stop()  # drains: the in-flight jobs finish before it returns
    assert len(results.completions) == 6 or await results.wait(lambda: len(results.completions) == 6, 5) is None
    await wait_committed(topics)


async def test_drain_timeout_aborts_without_commit(topics, results: Results) -> None:
    w = await started(topics, step_s=0.05)
    await submit(topics, [job(f"slow{i}", max_tokens=600, stream=True) for i in range(3)])
    await results.wait(lambda: len(w.jobs) == 3 and all(st.admitted for st in w.jobs.values()), 20)
    await w.stop(drain_timeout_s=0.3)
    assert w.stats.abandoned == 3 and not results.completions
    assert all(v is None or v == 0 for v in (await committed(topics)).values())
    w2 = await started(topics, step_s=0.0005)  # the next owner reruns them
    try:
        await results.wait(lambda: len(results.completions) == 3, 30)
        for jid, [c] in results.completions.items():
            assert c["status"] == "ok" and stream_text(results.deltas[jid], c["run_id"]) == c["choices"][0]["text"]
            assert c["attempt"] > min(d["attempt"] for d in results.deltas[jid])  # the stale partial stream is older
        await wait_committed(topics)
    finally:
        await w2.stop()
