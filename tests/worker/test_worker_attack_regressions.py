"""Regressions from helper-43's attack on the worker (2026-12-06), through the real broker and the
tiny-model engine. Each failed before its fix.

1. A job inherited by a duplicate record's partition after a revoke (``Partitions.abandon``'s
   heir) lost its LoRA adapter and answered from the base model (and, found by helper-54, the
   trace its record's traceparent started: the heir's span was a new root).
2. Jobs whose structured-output grammar compiles at admission were not counted as held: a burst of
   distinct schemas fetched the whole topic and never paused a partition.
3. ``Worker.stop`` waited for a frozen broker for as long as it stayed frozen (the final commit,
   LeaveGroup and the producer's flush had no time limit).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import struct
import time

import pytest
from aiokafka import TopicPartition

from qworker.messages import Job, Sampling
from qworker.worker.client import submit
from tests.engine.engine_support import HeldForward

from .conftest import Results
from .test_defects import partition_of, produce_raw
from .test_flow import engines, job, started  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(180)

PROMPT = "The capital of France is"


async def _direct(eng, lora) -> list[int]:
    from qworker.engine import SamplingParams

    ids: list[int] = []
    kw = {} if lora is None else {"lora_request": lora}
    async for out in eng.generate(f"direct-{time.monotonic_ns()}", eng.encode(PROMPT),
                                  SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), **kw):
        ids.extend(out.outputs[0].token_ids)
    return ids


async def _until(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_an_heir_answers_under_the_jobs_adapter(topics, results: Results, engines, tiny_model_dir, tmp_path) -> None:
    from tests.engine.lora_support import ALL_MODULES, make_peft_adapter

    root = tmp_path / "adapters"
    make_peft_adapter(tiny_model_dir, root / "a", rank=4, target_modules=ALL_MODULES, seed=1, b_std=1.0)
    s = topics.model_copy(update={"lora_modules": json.dumps({"a": str(root / "a")}), "lora_root": str(root)})
    # 16 blocks of 16 tokens: the blocker's 150 + 100 tokens take them all, so X waits in the queue
    eng = await engines(16, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    w = await started(s, eng)
    held = None
    try:
        want, base = await _direct(eng, w.adapters.served["a"]), await _direct(eng, None)
        assert want != base  # the adapter changes the greedy tokens
        held = HeldForward(eng.engine)  # busy with the blocker: X stays queued, not admitted
        blocker = Job(id="blocker", prompt_token_ids=[300] * 150, sampling=Sampling(max_tokens=100, temperature=0.0, ignore_eos=True))
        await submit(s, [blocker])
        await asyncio.to_thread(held.entered.wait, 20)
        home = partition_of(s, "X")
        x = Job(id="X", prompt=PROMPT, lora="a", sampling=Sampling(max_tokens=6, temperature=0.0, ignore_eos=True))
        await submit(s, [x])
        # X held from its home partition before the copy exists (helper-55: fetched the other way
        # round, the copy's record held the job and the revoke made no heir)
        await _until(lambda: "X" in w.jobs and w.jobs["X"].tp.partition == home, 20, "X held from its home partition")
        parent = b"00-bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb-bbbbbbbbbbbbbbbb-01"
        await produce_raw(s, s.jobs_topic, b"X-copy", x.model_dump_json().encode(), [("traceparent", parent)], partition=(home + 1) % 4)
        await _until(lambda: "X" in w.jobs and w.jobs["X"].waiters and not w.jobs["X"].admitted, 20, "X queued with a waiter")
        first = w.jobs["X"]
        made, real_job = [], w.telemetry.job
        w.telemetry.job = lambda *a, **k: made.append(a) or real_job(*a, **k)
        w.partitions.abandon({TopicPartition(s.jobs_topic, home)})  # the revoke of X's partition
        w.telemetry.job = real_job
        heir = w.jobs["X"]
        assert heir is not first and heir.lora is not None and heir.lora.lora_name == "a"
        # helper-54: the heir continues its own record's trace (it was started with no headers)
        (args,) = made
        assert args[4] == b"X-copy" and ("traceparent", parent) in list(args[5])
        held.release()
        await results.wait(lambda: "X" in results.completions, 60)
        (answer,) = results.completions["X"]
        assert answer["model"] == "a" and answer["choices"][0]["token_ids"] == want
    finally:
        if held is not None:
            held.release()  # a failure above must not leave the engine thread held (the stop hung)
        await w.stop()


async def test_jobs_whose_grammar_compiles_count_as_held(topics, results: Results, engines) -> None:
    s = topics.model_copy(update={"max_waiting_jobs": 4})
    eng = await engines()
    w = await started(s, eng)
    # compiles that take a while (a large schema's take seconds): each waits for the test
    release = asyncio.Event()
    real = eng.validate_structured

    async def slow(params):
        await release.wait()
        await real(params)

    eng.validate_structured = slow
    try:
        n = 30
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
        await submit(s, [job(f"v{i}", prompt="json:", max_tokens=4, response_format=fmt) for i in range(n)])
        await _until(lambda: w.intake.validating, 20, "a job compiling")
        peak, paused = 0, False
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            peak = max(peak, len(w.intake.validating) + len(w.registry.pending))
            paused |= w.pauser.paused
            await asyncio.sleep(0.02)
        # a poll takes at least one record even when full (aiokafka needs a positive max_records)
        assert paused and peak <= s.max_waiting_jobs + 1 and w.stats.records < n, (peak, paused, w.stats.records)
        release.set()
        await results.wait(lambda: len(results.completions) == n, 60)  # and then every job is answered
    finally:
        release.set()
        eng.validate_structured = real
        await w.stop()


async def test_stop_is_bounded_while_the_broker_is_frozen(broker, topics, results: Results, engines) -> None:
    s = topics.model_copy(update={"request_timeout_ms": 2000})
    eng = await engines(512)
    w = await started(s, eng)
    ids = [f"f{i}" for i in range(4)]
    await submit(s, [job(i, prompt=f"frozen {i}", max_tokens=900, stream=True) for i in ids])
    await results.wait(lambda: all(i in results.deltas for i in ids), 30, "every job streaming")
    os.kill(broker.proc.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        stop = asyncio.create_task(w.stop(1.0))
        done, _ = await asyncio.wait([stop], timeout=15)
        assert done, "stop() still waits for the frozen broker"
        stop.result()
        assert time.monotonic() - t0 < 1.0 + 2.0 + 3.0  # the drain, one request timeout, slack
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    # nothing was committed past them: a new worker answers every one
    w2 = await started(s, eng)
    try:
        await results.wait(lambda: all(i in results.completions for i in ids), 120, "every job answered")
    finally:
        await w2.stop()


# helper-82 (2026-12-07): an immediate error (wrong model, deadline passed) whose size check left
# 1 KiB for headers was refused by the producer once an 8 KiB producer tracestate rode along on its
# headers, and its offset was committed with no answer. The tracestate passed on is now bounded to
# W3C's 512 characters, so answers sized under the limit stay under it.
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
LONG_TRACESTATE = b",".join(b"k%03d=%s" % (i, b"v" * 255) for i in range(31))  # 8,090 bytes, kept by the SDK


async def test_immediate_errors_with_a_long_tracestate_are_answered(topics, results: Results, engines) -> None:
    limit = 32_768
    s = topics.model_copy(update={"max_message_bytes": limit})
    w = await started(s, await engines())
    try:
        headers = [("traceparent", TRACEPARENT), ("tracestate", LONG_TRACESTATE)]
        meta = {"blob": "x" * (limit - 4000)}  # each error with it fits the limit less the header room
        jobs = [Job(id="wrong-model", prompt="hi", sampling=Sampling(max_tokens=2), model="no-such-model", metadata=meta),
                Job(id="late", prompt="hi", sampling=Sampling(max_tokens=2), deadline=1.0, metadata=meta),
                Job(id="runs", prompt="hi", sampling=Sampling(max_tokens=2, temperature=0.0), metadata=meta)]
        for j in jobs:
            await produce_raw(s, s.jobs_topic, j.id.encode(), j.model_dump_json(exclude_none=True).encode(), headers, partition=0)
        await results.wait(lambda: {"wrong-model", "late", "runs"} <= set(results.completions), 60, "every job answered")
        assert results.completions["wrong-model"][0]["error"]["code"] == "wrong_model"
        assert results.completions["late"][0]["error"]["code"] == "deadline_exceeded"
        assert results.completions["runs"][0]["status"] == "ok"  # its body fits: the tracestate no longer crowds it out
        assert all(len(results.completions[j.id]) == 1 for j in jobs)
    finally:
        await w.stop()


# ------------------------------------------------------------------ the cancel topic re-created under the reader
def _cancel_reader(topics, monkeypatch, check_s: float, ids: bool = True):
    """A cancel reader checking its topic every ``check_s``, the job ids it was given, and the
    times its log check ran."""
    from qworker.worker import cancellation, topic_ids
    from qworker.worker.cancellation import CancelWatcher

    monkeypatch.setattr(cancellation, "LOG_CHECK_S", check_s)
    if not ids:
        async def unsupported(consumer, topic):
            raise topic_ids.TopicIdsUnsupported("as Kafka before 2.8")

        monkeypatch.setattr(topic_ids, "topic_id", unsupported)
    got: list[str] = []
    checks: list[float] = []
    real_check = CancelWatcher._check_log

    async def counted(self) -> None:
        await real_check(self)
        checks.append(time.monotonic())

    monkeypatch.setattr(CancelWatcher, "_check_log", counted)

    async def on_cancel(job_id: str, at: float) -> None:
        got.append(job_id)

    return CancelWatcher(topics.cancel_topic, topics.consumer_options(), on_cancel, 600.0), got, checks


@pytest.mark.parametrize(("new_partitions", "ids", "seen_gone"), [(1, True, True), (1, False, True), (3, True, True),
                                                                  (1, True, False), (1, False, False)])
async def test_the_cancel_reader_follows_its_topic_when_it_is_re_created(topics, monkeypatch, new_partitions, ids, seen_gone) -> None:
    """helper-116: the cancel reader assigned itself once, at start. After the cancel topic was
    deleted and re-created, it read on from its old position (a 1-partition log that grew past it
    lost its first cancels) or only the partitions it had (a new 3-partition topic was not read
    at all), and the job whose cancel it missed ran to completion. ``ids=False``: a broker that
    gives no topic ids. ``seen_gone=False`` (helper-119): the topic comes back between two checks
    and the reader reads the new log's records before the next one, so only a witness from
    before the change can tell (one taken from what was just read vouched for the new log)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from qworker.worker.client import cancel

    w, got, checks = _cancel_reader(topics, monkeypatch, 0.3 if seen_gone else 2.0, ids)
    admin = AIOKafkaAdminClient(bootstrap_servers=topics.bootstrap_servers)
    await admin.start()
    await w.start()
    try:
        for i in range(5):  # the reader's position moves to 5
            await cancel(topics, f"old-{i}")
        await _until(lambda: w.seen >= 5, 20, "the first cancels")
        n = len(checks)
        await _until(lambda: len(checks) >= n + 2, 20, "two checks of an unchanged topic")
        assert w.reassigned == 0, "an unchanged topic was taken for a new one"
        await admin.delete_topics([topics.cancel_topic])
        await asyncio.sleep(1.0 if seen_gone else 0.2)
        await admin.create_topics([NewTopic(topics.cancel_topic, new_partitions, 1)])
        new = ["victim", *(f"filler-{i}" for i in range(8))]  # the new log grows past the old position
        for job_id in new:
            await cancel(topics, job_id)
        await _until(lambda: set(new) <= set(got), 20, "every cancel of the new topic")
        assert w.reassigned >= 1 and w.alive()
    finally:
        await w.stop()
        await admin.close()


async def test_the_cancel_reader_checks_survive_odd_batches_without_false_alarms(topics, monkeypatch) -> None:
    """helper-119: (1) a gzip batch that does not inflate, after the witness record, made every
    log check raise inside ``record_at`` (it parsed the whole fetch) and the exception ended the
    reader for good; (2) a partition read only through the raw skip path had no witness and was
    checked by its end offset, which Tansu under-reports after a batched produce: the whole topic
    was read again at every check. Now ``record_at`` decodes only the witness's batch, a check
    that fails keeps the reader, and records read raw are witnesses too."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.record.util import calc_crc32c

    from qworker.worker.client import cancel

    from .kafka_batches import produce_batch, record_batch

    admin = AIOKafkaAdminClient(bootstrap_servers=topics.bootstrap_servers)
    await admin.start()
    await admin.delete_topics([topics.cancel_topic])
    await asyncio.sleep(0.5)
    await admin.create_topics([NewTopic(topics.cancel_topic, 3, 1)])
    await admin.close()
    w, got, checks = _cancel_reader(topics, monkeypatch, 0.3)
    await w.start()
    try:
        await asyncio.sleep(1.0)  # assigned
        producer = AIOKafkaProducer(bootstrap_servers=topics.bootstrap_servers, enable_idempotence=False, linger_ms=200)
        await producer.start()
        try:
            await producer.send_and_wait(topics.cancel_topic, key=b"first", value=b"", partition=0)
            await _until(lambda: "first" in got, 20, "the first cancel")
            bad = bytearray(record_batch(1, [(b"k", b"v" * 200, [])], codec=1))  # gzip, its deflate stream scrambled
            for i in range(61 + 12, len(bad) - 8):
                bad[i] ^= 0x5A
            struct.pack_into(">I", bad, 17, calc_crc32c(bytes(bad[21:])))
            await produce_batch(topics.bootstrap_servers, topics.cancel_topic, 0, bytes(bad))
            # partition 1: a batch aiokafka refuses (a header key that is not UTF-8), read raw
            await produce_batch(topics.bootstrap_servers, topics.cancel_topic, 1,
                                record_batch(0, [(b"raw-%d" % i, b"", [(b"\xff", b"")]) for i in range(3)]))
            # partition 2: five records in one produce request
            sent = [await producer.send(topics.cancel_topic, key=b"batched-%d" % i, value=b"", partition=2) for i in range(5)]
            await asyncio.gather(*sent)
        finally:
            await producer.stop()
        await cancel(topics, "after")
        want = {"after", *(f"raw-{i}" for i in range(3)), *(f"batched-{i}" for i in range(5))}
        await _until(lambda: want <= set(got), 20, "the later cancels")
        n = len(checks)
        await _until(lambda: len(checks) >= n + 4, 20, "four more checks")
        assert w.alive() and w.reassigned == 0, w.reassigned
    finally:
        await w.stop()


async def test_a_cancel_ttl_past_the_epoch_reads_from_the_beginning(topics) -> None:
    """helper-122: QWORKER_CANCEL_TTL_S=1e10 made the reader ask for offsets before 1970; the
    broker client refused the negative time and the reader died silently. Such a TTL now reads
    the topic from its beginning."""
    from qworker.worker.cancellation import CancelWatcher
    from qworker.worker.client import cancel

    await cancel(topics, "before-start")
    got: list[str] = []

    async def on_cancel(job_id: str, at: float) -> None:
        got.append(job_id)

    w = CancelWatcher(topics.cancel_topic, topics.consumer_options(), on_cancel, 1e10)
    await w.start()
    try:
        await _until(lambda: "before-start" in got, 20, "the cancel made before the reader started")
        assert w.alive()
    finally:
        await w.stop()
