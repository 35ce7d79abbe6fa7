"""The worker's Kafka behaviour against the real broker and the real engine: ``AsyncEngine`` over
the tiny random-weight Llama (``tiny_model_dir``: 2 layers, hidden 64, the real tokenizer) on
the CPU, a few ms a step. Outputs are compared with the offline ``LLM.generate`` greedy result
for the same input; slow jobs are made slow by their length and a small KV pool, never by a
stand-in."""

from __future__ import annotations

import asyncio
import time

import pytest

from qworker.messages import DLQ_HEADER_ERROR, DLQ_HEADER_OFFSET, DLQ_HEADER_TOPIC, Job, Sampling
from qworker.worker import Worker
from qworker.worker.client import cancel, submit

from tests.engine.engine_support import HeldForward

from .conftest import Results, committed, stream_text, wait_committed

pytestmark = pytest.mark.timeout(120)

# KV bytes per block of the tiny model (fp32 on the CPU): 2 layers * (k, v) * 16 tokens * 2 kv
# heads * 16 head_dim * 4 bytes.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4
BLOCK_TOKENS = 16
# CPU everywhere: the references must come from the same device as the runs, and the timing
# margins below assume CPU step times.
DEVICE = "cpu"


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The engine's step thread shares a few cores with the event loop, the broker and the
    reference runs; intra-op threads spinning against them make a tiny-model step several times
    slower. One thread for this module, then restore."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Offline:
    """Greedy references from ``qworker.LLM`` (one load per module), memoised by input."""

    def __init__(self, model_dir: str):
        from qworker import LLM

        self.llm = LLM(model_dir, device=DEVICE, kv_cache_memory=256 * BLOCK_BYTES, swap_space=0)
        self._cache: dict[tuple[str, int], object] = {}

    def refs(self, prompts: list[str], max_tokens: int) -> list:
        """One ``RequestOutput`` per prompt: ``temperature=0, ignore_eos=True, max_tokens``."""
        from qworker import SamplingParams

        todo = [p for p in dict.fromkeys(prompts) if (p, max_tokens) not in self._cache]
        if todo:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            outs = self.llm.generate([self.llm.engine.encode(p) for p in todo], params)
            for p, o in zip(todo, outs):
                assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == max_tokens
                self._cache[(p, max_tokens)] = o
        return [self._cache[(p, max_tokens)] for p in prompts]

    def ref(self, prompt: str, max_tokens: int):
        return self.refs([prompt], max_tokens)[0].outputs[0]

    def tokens(self, prompt: str, n: int) -> list[int]:
        """The first ``n`` greedy tokens, from any longer reference already computed."""
        for (p, m), o in self._cache.items():
            if p == prompt and m >= n:
                return list(o.outputs[0].token_ids[:n])
        return list(self.ref(prompt, n).token_ids)


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> Offline:
    return Offline(str(tiny_model_dir))


@pytest.fixture
async def engines(tiny_model_dir):
    """``make(blocks, **config)``: a started ``AsyncEngine`` with a KV pool of ``blocks`` blocks
    (no CPU swap space); all are shut down after the test (the workers do not own them)."""
    from qworker.engine import AsyncEngine

    made = []

    async def make(blocks: int = 128, **kw):
        eng = await asyncio.to_thread(
            AsyncEngine.from_model, str(tiny_model_dir), device=DEVICE, kv_cache_memory=blocks * BLOCK_BYTES, swap_space=0, **kw
        )
        made.append(eng)
        await eng.start()
        assert eng.capacity().total_tokens == blocks * BLOCK_TOKENS
        return eng

    yield make
    for eng in made:
        await eng.shutdown()


async def started(settings, engine) -> Worker:
    w = Worker(settings, engine)
    await w.start()
    return w


def job(i: int | str, prompt: str = "hello", max_tokens: int = 5, **kw) -> Job:
    """Greedy, and ``ignore_eos`` so that every run makes exactly ``max_tokens`` tokens."""
    return Job(id=str(i), prompt=prompt, sampling=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), **kw)


def engine_counts(eng) -> dict[str, int]:
    st = eng.stats()
    return {k: st[k] for k in ("requests_finished", "requests_aborted", "generation_tokens")}


async def engine_ran(eng, base: dict[str, int], timeout: float = 5.0, **want: int) -> None:
    """Wait until the engine's counters, less ``base`` (taken once the worker had started, so the
    worker's own warm-up is not counted), equal ``want``. Its stats are a snapshot the step thread
    takes, so they may trail the messages by a moment; the counters only grow."""
    deadline = time.monotonic() + timeout
    while True:
        now = engine_counts(eng)
        got = {k: now[k] - base[k] for k in want}
        if got == want:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engine counters since the start: {got}, expected {want}")
        await asyncio.sleep(0.05)


def assert_matches(c: dict, ref) -> None:
    """A completion message equals an offline greedy ``CompletionOutput``."""
    assert c["type"] == "completion" and c["status"] == "ok", c
    ch = c["choices"][0]
    assert ch["token_ids"] == list(ref.token_ids)
    assert ch["text"] == ref.text
    assert ch["finish_reason"] == ref.finish_reason == "length"


async def test_completion_stream_and_commit(topics, results: Results, engines, offline: Offline) -> None:
    jobs = [job(f"j{i}", prompt=f"prompt {i}", max_tokens=12, stream=True, metadata={"n": i}) for i in range(20)]
    refs = dict(zip((j.id for j in jobs), offline.refs([j.prompt for j in jobs], 12)))
    eng = await engines(64)
    w = await started(topics, eng)
    try:
        await submit(topics, jobs)
        await results.wait(lambda: len(results.completions) == 20, 30)
        for j in jobs:
            [c] = results.completions[j.id]
            assert c["type"] == "completion" and c["status"] == "ok" and c["metadata"] == j.metadata
            ref = refs[j.id]
            assert_matches(c, ref.outputs[0])
            text = c["choices"][0]["text"]
            # prompts shorter than a block: nothing can come from the prefix cache
            assert len(ref.prompt_token_ids) < BLOCK_TOKENS
            assert c["usage"] == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": 12, "cached_tokens": 0}
            assert c["timings"]["total_s"] >= c["timings"]["ttft_s"] >= 0
            assert stream_text(results.deltas[j.id], c["run_id"]) == text
            assert all(d["attempt"] == c["attempt"] for d in results.deltas[j.id])
        # committed offsets cover every record once their results were acknowledged
        await wait_committed(topics)
    finally:
        await w.stop()


async def test_rejects_and_dlq_then_keeps_serving(topics, results: Results, engines, offline: Offline) -> None:
    eng = await engines(64, max_model_len=100)
    long_prompt = " x" * 200
    assert len(eng.encode(long_prompt)) + 1 > eng.max_model_len == 100
    ok_ref = offline.ref("hello", 3)
    w = await started(topics, eng)
    base = engine_counts(eng)
    try:
        await submit(topics, [b"{not json", b'["a"]', b'{"prompt": "no id"}'])
        await submit(topics, [{"id": "bad-schema", "prompt": "x", "sampling": {"max_tokens": "many"}, "metadata": {"k": 1}}])
        await submit(topics, [job("too-long", prompt=long_prompt), job("expired", deadline=time.time() - 1), job("wrong-model", model="gpt-9")])
        await submit(topics, [{"id": "bad-sampling", "prompt": "x", "sampling": {"top_p": 0}}])
        await submit(topics, [job("ok-after", max_tokens=3)])
        await results.wait(lambda: len(results.completions) == 6 and len(results.dlq) == 3, 30)
        codes = {k: v[0]["error"]["code"] for k, v in results.completions.items() if v[0]["type"] == "error"}
        assert codes == {"bad-schema": "invalid_job", "too-long": "prompt_too_long", "expired": "deadline_exceeded", "wrong-model": "wrong_model", "bad-sampling": "invalid_job"}
        assert results.completions["bad-schema"][0]["metadata"] == {"k": 1}
        assert all(v[0]["error"]["retryable"] is False for k, v in results.completions.items() if k in codes)
        assert_matches(results.completions["ok-after"][0], ok_ref)
        reasons = sorted(dict(r.headers)[DLQ_HEADER_ERROR].decode() for r in results.dlq)
        assert reasons == ["no_id", "not_json", "not_object"]
        for r in results.dlq:
            h = dict(r.headers)
            assert h[DLQ_HEADER_TOPIC].decode() == topics.jobs_topic and int(h[DLQ_HEADER_OFFSET]) >= 0
        assert {r.value for r in results.dlq} == {b"{not json", b'["a"]', b'{"prompt": "no id"}'}
        await wait_committed(topics)
        # only the one valid job reached the engine
        await engine_ran(eng, base, requests_finished=1, requests_aborted=0, generation_tokens=3)
    finally:
        await w.stop()


async def test_duplicate_in_flight_runs_once(topics, results: Results, engines, offline: Offline) -> None:
    ref = offline.ref("hello", 200)
    eng = await engines()
    w = await started(topics, eng)
    base = engine_counts(eng)
    # the engine is held after dup's first token until the second record is seen, so the first
    # is still running then on any machine
    held = HeldForward(eng.engine, passes=1)
    try:
        # same key -> same partition: the second record arrives while the first is running
        await submit(topics, [job("dup", max_tokens=200)])
        await results.wait(lambda: "dup" in w.jobs and w.jobs["dup"].generated > 0, 20, "dup running")
        await submit(topics, [job("dup", max_tokens=200)])
        await results.wait(lambda: w.stats.duplicates == 1, 20, "the second record seen")
        held.release()
        await results.wait(lambda: "dup" in results.completions, 30)
        await asyncio.sleep(0.5)
        assert len(results.completions["dup"]) == 1
        assert_matches(results.completions["dup"][0], ref)
        assert w.stats.duplicates == 1
        # the engine ran it once: one request, nothing aborted, 200 tokens in all
        await engine_ran(eng, base, requests_finished=1, requests_aborted=0, generation_tokens=200)
        await wait_committed(topics)  # both records
    finally:
        held.release()
        await w.stop()


async def test_cancel_in_flight_and_before_arrival(topics, results: Results, engines, offline: Offline) -> None:
    eng = await engines()
    w = await started(topics, eng)
    base = engine_counts(eng)
    # after its first token the engine is held until the abort is queued: "long" cannot run to
    # its end before the cancel lands, however fast the machine
    held = HeldForward(eng.engine, passes=1)
    try:
        await asyncio.sleep(1.0)  # the cancel reader is assigned
        await submit(topics, [job("long", max_tokens=900, stream=True)])
        await results.wait(lambda: "long" in results.deltas, 20)
        await cancel(topics, "long")
        await cancel(topics, "later")  # arrives before its job
        await results.wait(lambda: "long" not in w.jobs or w.jobs["long"].cancel_requested, 20, "the cancel of long")
        held.release()
        await results.wait(lambda: "long" in results.completions, 30)
        c = results.completions["long"][0]
        assert c["status"] == "cancelled" and c["choices"][0]["finish_reason"] == "cancelled"
        n = c["usage"]["completion_tokens"]
        assert 0 < n < 900
        # what it made before the abort is the greedy prefix, and the stream carries all of it
        assert c["choices"][0]["token_ids"] == offline.tokens("hello", n)
        assert stream_text(results.deltas["long"], c["run_id"]) == c["choices"][0]["text"]
        await engine_ran(eng, base, requests_finished=0, requests_aborted=1, generation_tokens=n)
        await results.wait(lambda: "later" in w.cancels, 20, "the cancel of later read")
        await submit(topics, [job("later")])
        await results.wait(lambda: "later" in results.completions, 20)
        assert results.completions["later"][0]["status"] == "cancelled"
        await engine_ran(eng, base, requests_finished=0, requests_aborted=1)  # "later" never reached the engine
        await wait_committed(topics)
    finally:
        held.release()
        await w.stop()


async def test_backpressure_pauses_and_bounds_memory(topics, results: Results, engines, offline: Offline) -> None:
    # a KV pool of 8 blocks (128 tokens) holds two 50-token jobs at a time; 4 queued locally at most
    prompt = " p" * 30
    ref = offline.ref(prompt, 20)
    eng = await engines(8)
    assert len(eng.encode(prompt)) == 30
    s = topics.model_copy(update={"max_waiting_jobs": 4, "admission_reserve_tokens": 20})
    w = await started(s, eng)
    peak = {"pending": 0, "generating": 0, "engine_running": 0}

    async def watch() -> None:
        while True:
            peak["pending"] = max(peak["pending"], len(w.pending))
            # admitted and not done generating (a finished job may still be publishing)
            peak["generating"] = max(peak["generating"], sum(1 for st in w.jobs.values() if st.admitted and st.generated < st.max_new_tokens))
            peak["engine_running"] = max(peak["engine_running"], eng.capacity().num_running)
            await asyncio.sleep(0.005)

    t = asyncio.create_task(watch())
    try:
        await submit(s, [job(f"bp{i}", prompt=prompt, max_tokens=20) for i in range(50)])
        await results.wait(lambda: len(results.completions) == 50, 60)
        for v in results.completions.values():
            assert_matches(v[0], ref)
        assert w.stats.pause_events >= 1
        assert peak["pending"] <= 4
        assert peak["generating"] <= 3 and peak["engine_running"] <= 3
        await wait_committed(s)
    finally:
        t.cancel()
        await w.stop()


async def test_two_workers_rebalance_no_loss(topics, results: Results, engines, offline: Offline) -> None:
    ref = offline.ref("hello", 40)
    # 16 blocks (256 tokens): about five 41-token jobs at a time, so the work outlasts the join
    e1, e2 = await engines(16), await engines(16)
    w1 = await started(topics, e1)
    try:
        await submit(topics, [job(f"a{i}", max_tokens=40) for i in range(30)])
        await results.wait(lambda: any(st.admitted for st in w1.jobs.values()), 20, "w1 running")
        rebalances = w1.stats.rebalances
        w2 = await started(topics, e2)  # joins mid-flight: partitions move
        try:
            await submit(topics, [job(f"b{i}", max_tokens=40) for i in range(30)])
            await results.wait(lambda: len(results.completions) == 60, 60)
            deadline = time.monotonic() + 15
            while not (w1.consumer.assignment() and w2.consumer.assignment()):
                assert time.monotonic() < deadline, "the group never split"
                await asyncio.sleep(0.2)
            assert not (w1.consumer.assignment() & w2.consumer.assignment())
            # no job lost, none corrupted: every answer (a rerun may answer twice) is the greedy one
            for jid, cs in results.completions.items():
                for c in cs:
                    assert_matches(c, ref)
            assert w1.stats.rebalances > rebalances
            await wait_committed(topics)
        finally:
            await w2.stop()
    finally:
        await w1.stop()


async def test_drain_finishes_in_flight_and_commits(topics, results: Results, engines, offline: Offline) -> None:
    ref = offline.ref("hello", 200)
    eng = await engines(128)  # 2048 tokens: all six 201-token jobs run at once
    w = await started(topics, eng)
    await submit(topics, [job(f"d{i}", max_tokens=200) for i in range(6)])
    await results.wait(lambda: len(w.jobs) == 6 and all(st.admitted and st.generated > 0 for st in w.jobs.values()), 20)
    assert not results.completions  # still in flight when the drain starts
    await w.stop()  # drains: the in-flight jobs finish before it returns
    assert w.stats.completed == 6 and w.stats.abandoned == 0
    assert len(results.completions) == 6 or await results.wait(lambda: len(results.completions) == 6, 5) is None
    for v in results.completions.values():
        assert_matches(v[0], ref)
    await wait_committed(topics)


async def test_drain_timeout_aborts_without_commit(topics, results: Results, engines, offline: Offline) -> None:
    ref = offline.ref("hello", 200)
    e1, e2 = await engines(), await engines()
    w = await started(topics, e1)
    base = engine_counts(e1)
    await submit(topics, [job(f"slow{i}", max_tokens=200, stream=True) for i in range(3)])
    # all three running and streaming: the next owner will see a stale partial stream
    await results.wait(lambda: len(w.jobs) == 3 and all(st.admitted for st in w.jobs.values()) and len(results.deltas) == 3, 20)
    await w.stop(drain_timeout_s=0.1)  # 200 steps take several times longer
    assert w.stats.abandoned == 3 and not results.completions
    assert all(v is None or v == 0 for v in (await committed(topics)).values())
    await engine_ran(e1, base, requests_finished=0, requests_aborted=3)  # nothing left running there
    w2 = await started(topics, e2)  # the next owner reruns them
    try:
        await results.wait(lambda: len(results.completions) == 3, 30)
        for jid, [c] in results.completions.items():
            assert_matches(c, ref)
            assert stream_text(results.deltas[jid], c["run_id"]) == c["choices"][0]["text"]
            assert c["attempt"] > min(d["attempt"] for d in results.deltas[jid])  # the stale partial stream is older
        await wait_committed(topics)
    finally:
        await w2.stop()
