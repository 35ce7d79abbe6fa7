"""Regression tests for issue 12 (worker defects), through the real broker and the tiny-model
engine (see test_flow). Each one failed on the worker before the fix."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy

from qworker.messages import DLQ_HEADER_ERROR, DLQ_HEADER_RAW_HEADERS, Job, Sampling
from qworker.worker import Worker
from qworker.worker.client import cancel, submit

from tests.engine.engine_support import EngineClock, HeldForward
from tests.worker.kafka_batches import RawKey, produce_batch

from .conftest import REPO, Results, committed, stream_text, wait_committed
from .test_flow import Offline, engines, job, offline, one_torch_thread, started  # noqa: F401 - fixtures
from .test_outage import check_commits_delivered

pytestmark = pytest.mark.timeout(120)


async def produce_raw(s, topic: str, key: bytes | None, value: bytes | None, headers: list, partition: int = 0, timestamp_ms: int | None = None) -> None:
    p = AIOKafkaProducer(bootstrap_servers=s.bootstrap_servers, enable_idempotence=False)
    await p.start()
    try:
        batch = p.create_batch()
        batch._builder = _DefaultRecordBatchBuilderPy(2, 0, 0, -1, -1, -1, 1 << 20)
        batch.append(key=key, value=value, timestamp=timestamp_ms, headers=headers)
        batch.close()
        await (await p.send_batch(batch, topic, partition=partition))
    finally:
        await p.stop()


def partition_of(s, key: str) -> int:
    from aiokafka.partitioner import DefaultPartitioner

    return DefaultPartitioner()(key.encode(), list(range(4)), list(range(4)))


# ---------------------------------------------------------------------------------- defect 1
async def test_bad_header_key_goes_to_dlq_and_partition_keeps_serving(topics, results: Results, engines) -> None:
    eng = await engines()
    w = await started(topics, eng)
    try:
        await asyncio.sleep(1.0)  # the cancel reader is assigned
        p = partition_of(topics, "after-0")
        await submit(topics, [job("before", max_tokens=2)])
        bad_value = Job(id="bad-header", prompt="x", sampling=Sampling(max_tokens=2)).model_dump_json().encode()
        await produce_raw(topics, topics.jobs_topic, b"bad-header", bad_value, [(RawKey(b"\xff\xfe-bad"), b"v"), ("ok", None)], partition=p)
        await produce_raw(topics, topics.cancel_topic, b"x", b"{}", [(RawKey(b"\xff"), b"")])  # and the cancel reader
        await submit(topics, [job(f"after-{i}", max_tokens=2) for i in range(6)])
        await results.wait(lambda: len(results.completions) == 7 and len(results.dlq) == 1, 30)
        [d] = results.dlq
        h = dict(d.headers)
        assert h[DLQ_HEADER_ERROR] == b"bad_headers" and d.key == b"bad-header" and d.value == bad_value
        assert h[DLQ_HEADER_RAW_HEADERS] == b'[["fffe2d626164", "76"], ["6f6b", null]]'
        await wait_committed(topics)
        # the cancel reader survived its bad record too
        await submit(topics, [job("cancel-me", max_tokens=900, stream=True)])
        await results.wait(lambda: "cancel-me" in results.deltas, 20)
        await cancel(topics, "cancel-me")
        await results.wait(lambda: "cancel-me" in results.completions, 20)
        assert results.completions["cancel-me"][0]["status"] == "cancelled"
        assert w.loops_alive()
    finally:
        await w.stop()


async def test_a_batch_aiokafka_refuses_is_read_whole_and_the_partitions_keep_serving(topics, results: Results, engines) -> None:
    """A bad record inside a batch of several (any producer that batches or compresses writes
    such batches): aiokafka refuses the whole batch and the broker serves it whole from its base
    offset, so seeking past the bad record alone re-read the same batch forever (the good records
    after it, and everything later on the partition, were never answered; on the cancel topic
    every later cancel was ignored). A null header key, or a CRC that does not hold, made aiokafka
    raise CorruptRecordException, which was retried forever."""
    from orjson import dumps

    from tests.worker.kafka_batches import record_batch

    eng = await engines()
    w = await started(topics, eng)
    try:
        await asyncio.sleep(1.0)  # the cancel reader is assigned
        bs, jobs, p = topics.bootstrap_servers, topics.jobs_topic, partition_of(topics, "after-0")

        def rec(jid: str, headers=()) -> tuple:
            return jid.encode(), job(jid, max_tokens=2).model_dump_json().encode(), list(headers)

        await produce_batch(bs, jobs, p, record_batch(0, [rec("g0"), rec("g1"), rec("bad-key", [(b"\xff\xfe", b"v")]), rec("g2")], codec=1))
        await produce_batch(bs, jobs, p, record_batch(0, [rec("g3"), rec("null-key", [("", b"NUL")]), rec("g4")], null_key_marker=b"NUL"))
        torn = bytearray(record_batch(0, [rec("torn-0"), rec("torn-1")]))
        torn[-1] ^= 0xFF  # its CRC no longer holds: the bytes cannot be trusted
        await produce_batch(bs, jobs, p, bytes(torn))
        await submit(topics, [job(f"after-{i}", max_tokens=2) for i in range(3)])
        good = {"g0", "g1", "g2", "g3", "g4", "after-0", "after-1", "after-2"}
        await results.wait(lambda: good <= set(results.completions) and len(results.dlq) == 3, 30)
        assert not {"bad-key", "null-key", "torn-0", "torn-1"} & set(results.completions)
        codes = sorted((dict(d.headers)[DLQ_HEADER_ERROR], d.key) for d in results.dlq)
        assert codes == [(b"bad_headers", b"bad-key"), (b"bad_headers", b"null-key"), (b"corrupt_batch", None)], codes
        [kept] = [d for d in results.dlq if d.key is None]
        assert kept.value[16:] == bytes(torn)[16:]  # as stored (the broker sets the base offset and the leader epoch)
        await wait_committed(topics)
        # the cancel reader: a batch with a bad record and then the cancel of a running job
        await submit(topics, [job("cancel-me", max_tokens=900, stream=True)])
        await results.wait(lambda: "cancel-me" in results.deltas, 20)
        await produce_batch(bs, topics.cancel_topic, 0, record_batch(0, [(b"x", b"{}", [(b"\xff", b"")]),
                                                                          (b"cancel-me", dumps({"job_id": "cancel-me"}), [])]))
        await results.wait(lambda: "cancel-me" in results.completions, 20)
        assert results.completions["cancel-me"][0]["status"] == "cancelled"
        assert w.loops_alive()
    finally:
        await w.stop()


async def test_a_refused_batch_is_taken_within_max_waiting_jobs(topics, results: Results, engines) -> None:
    """Every record of a refused batch was taken at once (300 held jobs under max_waiting_jobs=4):
    now it is taken a room's worth at a time, resuming after the last record taken, and every job
    is still answered once."""
    from tests.worker.kafka_batches import record_batch

    eng = await engines()
    w = await started(topics.model_copy(update={"max_waiting_jobs": 4}), eng)
    held = HeldForward(eng.engine)
    try:
        recs = [(b"bad", b"{}", [(b"\xff", b"v")])] + [(f"x{i}".encode(), job(f"x{i}", max_tokens=1).model_dump_json().encode(), []) for i in range(40)]
        await produce_batch(topics.bootstrap_servers, topics.jobs_topic, 0, record_batch(0, recs))
        peak = 0
        for _ in range(30):
            peak = max(peak, len(w.registry.pending))
            await asyncio.sleep(0.1)
        assert 1 <= peak <= 4, peak
        # a small refused batch on another partition is not starved by the large one (it waited
        # until all 40 were taken: the room went to the first partition in sorted order each time)
        other = 1
        await produce_batch(topics.bootstrap_servers, topics.jobs_topic, other,
                            record_batch(0, [(b"bad2", b"{}", [(b"\xff", b"v")]), (b"P1", job("P1", max_tokens=1).model_dump_json().encode(), [])]))
        held.release()
        await results.wait(lambda: {f"x{i}" for i in range(40)} | {"P1"} <= set(results.completions) and len(results.dlq) == 2, 60)
        assert all(len(results.completions[f"x{i}"]) == 1 for i in range(40))
        order = list(results.completions)
        assert order.index("P1") < max(order.index(f"x{i}") for i in range(40)) - 8, order
        await wait_committed(topics)
    finally:
        held.release()
        await w.stop()


async def test_records_fetched_before_a_rebalance_are_fetched_again(topics, results: Results, engines) -> None:
    """A partition lost and regained while fetched records were being decoded: the consumer
    rewound to the committed offset, but the stale records were registered in the fresh tracker,
    so the rewound fetch took the jobs below them for refetches and the next commit stepped
    over them (never answered; reproduced with a second group member by the review). Now records
    of another epoch are dropped and fetched again: here the rebalance is emulated (the epoch
    moves, the consumer rewinds as aiokafka does), and every job must still be answered once."""
    eng = await engines()
    w = await started(topics, eng)
    intake, real = w.intake, w.intake.handle_records
    bumped = []

    async def rebalanced_meanwhile(records, epoch):
        if records and not bumped:  # as if a rebalance ran (and ended) during the decode
            bumped.append(len(records))
            w.partitions.epoch += 2
            for tp in {tp for tp, _ in records}:
                w.consumer.seek(tp, min(r.offset for t, r in records if t == tp))
        return await real(records, epoch)

    intake.handle_records = rebalanced_meanwhile
    try:
        await submit(topics, [job(f"e{i}", max_tokens=1) for i in range(6)])
        await results.wait(lambda: {f"e{i}" for i in range(6)} <= set(results.completions), 30)
        assert bumped and all(len(results.completions[f"e{i}"]) == 1 for i in range(6))
        await wait_committed(topics)
    finally:
        await w.stop()


async def test_dead_loop_fails_healthz(topics, engines) -> None:
    eng = await engines()
    w = await started(topics.model_copy(update={"http_port": 0, "http_host": "127.0.0.1"}), eng)
    try:
        url = f"http://127.0.0.1:{w.http.port}/healthz"
        assert (await asyncio.to_thread(urllib.request.urlopen, url, None, 5)).status == 200
        w._loops[0].cancel()  # the poll loop is gone
        while not w._loops[0].done():
            await asyncio.sleep(0.01)
        with pytest.raises(urllib.error.HTTPError) as e:
            await asyncio.to_thread(urllib.request.urlopen, url, None, 5)
        assert e.value.code == 503 and b'"worker_loops": false' in e.value.read()
    finally:
        await w.stop()


# ---------------------------------------------------------------------------------- defect 2
async def test_broker_stall_only_delays(broker, topics, results: Results, engines) -> None:
    # request_timeout 2 s against a 6 s freeze: buffered sends time out, acknowledgements fail
    s = topics.model_copy(update={"request_timeout_ms": 2000, "linger_ms": 5})
    eng = await engines(512)  # room for all six at once: they generate through the freeze
    w = await started(s, eng)
    ids = [f"st{i}" for i in range(6)]
    try:
        await submit(s, [job(i, prompt=f"stall {i}", max_tokens=1000, stream=True) for i in ids])
        await results.wait(lambda: all(i in results.deltas for i in ids), 30, "every job streaming")
        os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(6)
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
        await results.wait(lambda: all(i in results.completions for i in ids), 90, "every job answered")
        await asyncio.sleep(1.0)
        for i in ids:
            per_attempt: dict[int, int] = {}
            for c in results.completions[i]:
                assert c["type"] == "completion" and c["status"] == "ok", c  # never engine_error
                per_attempt[c["attempt"]] = per_attempt.get(c["attempt"], 0) + 1
                # no gap, no repeated seq in the completion's stream, and it carries the text
                assert stream_text(results.deltas[i], c["run_id"]) == c["choices"][0]["text"]
                assert len(c["choices"][0]["token_ids"]) == 1000
            assert all(n == 1 for n in per_attempt.values()), per_attempt
        await wait_committed(s, timeout=30)
        await check_commits_delivered(s)
        assert w.loops_alive()
    finally:
        await w.stop()


# ---------------------------------------------------------------------------------- defect 3
async def test_result_over_max_message_bytes_answers_result_too_large(topics, results: Results, engines) -> None:
    s = topics.model_copy(update={"max_message_bytes": 16_384})
    eng = await engines()
    w = await started(s, eng)
    try:
        big = Job(id="big", prompt="hello", sampling=Sampling(max_tokens=40, n=4, logprobs=20, temperature=0.0, ignore_eos=True), metadata={"m": 1})
        await submit(s, [big, job("small", max_tokens=2)])
        await results.wait(lambda: {"big", "small"} <= set(results.completions), 30)
        [e] = results.completions["big"]
        assert e["type"] == "error" and e["error"]["code"] == "result_too_large" and e["error"]["retryable"] is False
        assert "16384" in e["error"]["message"] and e["metadata"] == {"m": 1}
        assert results.completions["small"][0]["status"] == "ok"
        await wait_committed(s)
    finally:
        await w.stop()


# ---------------------------------------------------------------------------------- defect 4
def nested(depth: int) -> dict:
    d: dict = {"leaf": 1}
    for _ in range(depth - 1):
        d = {"a": d}
    return d


async def test_deep_metadata_and_failed_result_get_errors(topics, results: Results, engines) -> None:
    eng = await engines()
    w = await started(topics, eng)
    real_run = w.runner.run

    async def broken(st):
        if st.job.id == "boom":
            raise RuntimeError("bug while building the result")
        return await real_run(st)

    w.runner.run = broken
    try:
        await submit(topics, [{"id": "deep", "prompt": "x", "metadata": nested(300)}, {"id": "deep40", "prompt": "x", "metadata": nested(40)}])
        await submit(topics, [job("ok32", max_tokens=2, metadata=nested(32)), job("boom", max_tokens=2)])
        # the engine's vocabulary check (not the schema) rejects this one
        await submit(topics, [{"id": "vocab", "prompt": "x", "sampling": {"stop_token_ids": [49152]}}])
        await results.wait(lambda: len(results.completions) == 5, 30)
        code = {k: (v[0]["error"]["code"] if v[0]["type"] == "error" else v[0]["status"]) for k, v in results.completions.items()}
        assert code == {"deep": "invalid_job", "deep40": "invalid_job", "ok32": "ok", "boom": "internal_error", "vocab": "invalid_sampling"}
        assert "metadata" in results.completions["deep"][0]["error"]["message"]
        assert results.completions["ok32"][0]["metadata"] == nested(32)
        await wait_committed(topics)
    finally:
        await w.stop()


# ---------------------------------------------------------------------------------- defect 5
async def test_stop_during_start_never_joins(topics, results: Results, engines) -> None:
    e1, e2 = await engines(), await engines()
    w1 = await started(topics, e1)
    try:
        await asyncio.sleep(1.0)
        rebalances = w1.stats.rebalances
        w2 = Worker(topics, e2)
        t = asyncio.create_task(w2.start())
        await asyncio.sleep(0)  # start() is inside its first await (the warm-up)
        w2.request_stop()  # SIGTERM while loading
        await t
        assert w2.consumer is None and not w2.joined
        await w2.stop()
        await asyncio.sleep(3.0)  # a join would have rebalanced w1 by now (session 3 s)
        assert w1.stats.rebalances == rebalances
        await submit(topics, [job(f"s{i}", max_tokens=2) for i in range(4)])
        await results.wait(lambda: len(results.completions) == 4, 20)
        assert all(v[0]["attempt"] == results.completions["s0"][0]["attempt"] for v in results.completions.values())
    finally:
        await w1.stop()


# ---------------------------------------------------------------------------------- defect 6
async def test_deadline_checked_when_the_engine_would_start_the_job(topics, results: Results, engines, monkeypatch) -> None:
    from qworker.engine import llm_engine

    eng = await engines(128, max_num_seqs=1)
    w = await started(topics, eng)
    clock = EngineClock()
    monkeypatch.setattr(llm_engine, "time", clock)
    held = HeldForward(eng.engine)
    try:
        # "long" holds the engine's only sequence slot: its first forward is held ...
        await submit(topics, [job("long", max_tokens=20)])
        await results.wait(held.entered.is_set, 20, "long's first forward")
        # ... while this one is handed to the engine, where it can start only after "long"; its
        # deadline is far enough for the worker to admit it on any machine
        deadline = time.time() + 60
        await submit(topics, [job("late", max_tokens=5, deadline=deadline)])
        await results.wait(lambda: "late" in w.jobs and w.jobs["late"].admitted, 20, "late handed to the engine")
        # for the engine the deadline has now passed, with "long" still running
        clock.offset = 120.0
        held.release()
        await results.wait(lambda: {"long", "late"} <= set(results.completions), 60)
        [late] = results.completions["late"]
        assert late["type"] == "error" and late["error"]["code"] == "deadline_exceeded" and late["error"]["retryable"] is False
        assert results.completions["long"][0]["status"] == "ok"
        await wait_committed(topics)
    finally:
        held.release()
        await w.stop()


# ---------------------------------------------------------------------------------- defect 7
async def test_cancel_before_first_step_and_after_last_token(topics, results: Results, engines, offline: Offline) -> None:
    eng = await engines()
    w = await started(topics, eng)
    real_generate = eng.generate

    async def registered(jid: str) -> None:
        await cancel(topics, jid)
        await results.wait(lambda: jid in w.cancels, 10, f"cancel of {jid} read")

    async def gen(request_id, prompt, params, **kw):
        jid = request_id.split("#")[0]
        if jid == "early":  # the cancel lands before the engine heard of the request
            await registered(jid)
        async for out in real_generate(request_id, prompt, params, **kw):
            if out.finished and jid == "late":  # ... after the last token, before the completion
                await registered(jid)
            yield out

    eng.generate = gen
    try:
        await asyncio.sleep(1.0)  # the cancel reader is assigned
        await submit(topics, [job("early", max_tokens=300), job("late", max_tokens=20)])
        await results.wait(lambda: {"early", "late"} <= set(results.completions), 60)
        [early] = results.completions["early"]
        assert early["status"] == "cancelled" and early["choices"][0]["finish_reason"] == "cancelled"
        assert early["usage"]["completion_tokens"] < 300
        [late] = results.completions["late"]  # complete before the cancel took effect: it stands
        assert late["status"] == "ok" and late["choices"][0]["finish_reason"] == "length"
        assert late["choices"][0]["token_ids"] == offline.tokens("hello", 20)
        await wait_committed(topics)
    finally:
        eng.generate = real_generate
        await w.stop()


# ---------------------------------------------------------------------------------- defect 8
async def test_cancel_older_than_ttl_is_ignored(topics, results: Results, engines) -> None:
    s = topics.model_copy(update={"cancel_ttl_s": 5.0})
    eng = await engines()
    w = await started(s, eng)
    try:
        await asyncio.sleep(1.0)  # the cancel reader is assigned and reading live
        old = int((time.time() - 60) * 1000)  # made a minute ago, read only now
        await produce_raw(s, s.cancel_topic, b"stale", b'{"job_id":"stale"}', [], timestamp_ms=old)
        await cancel(s, "fresh")
        await results.wait(lambda: "fresh" in w.cancels, 10)
        await submit(s, [job("stale", max_tokens=2), job("fresh", max_tokens=2)])
        await results.wait(lambda: {"stale", "fresh"} <= set(results.completions), 20)
        assert results.completions["stale"][0]["status"] == "ok"
        assert results.completions["fresh"][0]["status"] == "cancelled"
    finally:
        await w.stop()


# ---------------------------------------------------------------------------------- defect 9
async def test_dlq_keeps_original_bytes(topics, results: Results, engines) -> None:
    eng = await engines()
    w = await started(topics, eng)
    try:
        headers = [("a", b"\x00\xff"), ("n", None), ("a", b"dup")]
        await produce_raw(topics, topics.jobs_topic, None, b"\xff\xfe not json", headers)
        await produce_raw(topics, topics.jobs_topic, b"\xc3\x28", None, [])  # non-UTF-8 key, null value
        await produce_raw(topics, topics.jobs_topic, None, None, [("only", b"headers")])
        await results.wait(lambda: len(results.dlq) == 3, 20)
        got = sorted(((r.key, r.value, [h for h in r.headers if not h[0].startswith("qworker.")]) for r in results.dlq), key=repr)
        assert got == sorted([(None, b"\xff\xfe not json", headers), (b"\xc3\x28", None, []), (None, None, [("only", b"headers")])], key=repr)
        for r in results.dlq:
            assert r.headers[-6][0] == DLQ_HEADER_ERROR  # the reasons follow the original headers
        await wait_committed(topics)
    finally:
        await w.stop()


# --------------------------------------------------------------------------------- defect 10
async def test_large_prompts_do_not_block_the_loop(topics, results: Results, engines) -> None:
    eng = await engines()
    w = await started(topics, eng)
    worst = 0.0

    async def lag() -> None:
        nonlocal worst
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(0.02)
            worst = max(worst, time.monotonic() - t0 - 0.02)

    t = asyncio.create_task(lag())
    try:
        prompt = "word " * 300_000  # 1.5 M characters: about a second of tokenizing each
        await submit(topics, [Job(id=f"big{i}", prompt=prompt, sampling=Sampling(max_tokens=1)) for i in range(3)])
        await results.wait(lambda: len(results.completions) == 3, 60)
        assert all(v[0]["error"]["code"] == "prompt_too_long" for v in results.completions.values())
        assert worst < 1.0, f"the event loop stalled for {worst:.2f}s"  # inline tokenizing: about 5 s
    finally:
        t.cancel()
        await w.stop()


# --------------------------------------------------------------------------------- defect 11
def test_port_clash_one_line_exit_2(topics) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        env = dict(os.environ, QWORKER_HTTP_PORT=str(port), QWORKER_HTTP_HOST="127.0.0.1", QWORKER_BOOTSTRAP_SERVERS=topics.bootstrap_servers, QWORKER_MODEL="/nonexistent")
        p = subprocess.run([sys.executable, "-m", "qworker.cli", "run"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in p.stderr and len(lines) == 1 and "QWORKER_HTTP_PORT" in lines[0], p.stderr


# ------------------------------------------------------------------------ suspected: revoke race
async def test_revoke_racing_a_delivery_with_a_waiter_elsewhere_answers_once(topics, results: Results, engines) -> None:
    from aiokafka import TopicPartition

    eng = await engines()
    w = await started(topics, eng)
    home = partition_of(topics, "raced")
    other = (home + 1) % 4
    real_deliver = w.publisher.deliver
    raced = []

    async def deliver(topic, key, value, headers=None):
        await real_deliver(topic, key, value, headers)
        if topic == topics.completions_topic and key == "raced" and not raced:
            raced.append(1)  # acknowledged; now the home partition is revoked
            w.partitions.abandon({TopicPartition(topics.jobs_topic, home)})

    w.publisher.deliver = deliver
    try:
        await submit(topics, [job("raced", max_tokens=200)])
        await results.wait(lambda: "raced" in w.jobs and w.jobs["raced"].generated > 0, 20)
        dup = Job(id="raced", prompt="hello", sampling=Sampling(max_tokens=200, temperature=0.0, ignore_eos=True)).model_dump_json().encode()
        await produce_raw(topics, topics.jobs_topic, b"raced", dup, [], partition=other)
        await results.wait(lambda: w.stats.duplicates == 1, 10, "the duplicate attached")
        await results.wait(lambda: "raced" in results.completions, 30)
        await asyncio.sleep(2.0)  # a rerun of 200 tokens would have answered by now
        assert len(results.completions["raced"]) == 1
        assert (await committed(topics))[other] == 1  # the waiter's record is answered and committed
    finally:
        await w.stop()
