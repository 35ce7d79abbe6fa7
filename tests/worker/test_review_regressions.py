"""Regression tests for defects found by the review of the issue-12 fixes. Each failed before
its fix (see the docstrings); fast: units, in-process CLI runs and the tiny model."""

from __future__ import annotations

import asyncio
import random
import struct
import time
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from qworker.messages import dumps

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ configuration and start-up
@pytest.mark.parametrize(
    "env, var",
    [
        ({"QWORKER_MAX_WAITING_JOBS": "abc"}, "QWORKER_MAX_WAITING_JOBS"),
        ({"QWORKER_KV_CACHE_MEMORY": "lots"}, "QWORKER_KV_CACHE_MEMORY"),
        ({"QWORKER_LOG_LEVEL": "bogus"}, "QWORKER_LOG_LEVEL"),  # was a ValueError from logging
        ({"QWORKER_STREAM_INTERVAL_MS": "0"}, "QWORKER_STREAM_INTERVAL_MS"),  # was a busy ticker
        ({"QWORKER_COMMIT_INTERVAL_MS": "0"}, "QWORKER_COMMIT_INTERVAL_MS"),
        ({"QWORKER_HTTP_PORT": "70000"}, "QWORKER_HTTP_PORT"),  # was an OverflowError at bind
        ({"QWORKER_HTTP_PORT": "-1", "QWORKER_MODEL": "/nonexistent"}, "QWORKER_MODEL"),  # was a transformers traceback
        ({"QWORKER_HTTP_PORT": "-1"}, "QWORKER_MODEL"),  # no model at all
    ],
)
def test_misconfiguration_is_one_line_exit_2(env: dict, var: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a pydantic ValidationError / ValueError / OSError traceback, exit status 1."""
    from qworker import cli

    for k in ("QWORKER_MODEL", "QWORKER_HTTP_PORT", "QWORKER_LOG_LEVEL"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("QWORKER_LOG_FORMAT", "text")
    monkeypatch.setenv("QWORKER_LOG_LEVEL", env.get("QWORKER_LOG_LEVEL", "ERROR"))
    r = CliRunner().invoke(cli.app, ["run"])
    err = r.stderr
    assert r.exit_code == 2, (r.exit_code, err, r.exception)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err and len(lines) == 1 and var in lines[0], err


def test_unknown_option_is_one_line_exit_2() -> None:
    from qworker import cli

    r = CliRunner().invoke(cli.app, ["run", "-o", "bogus_setting=1"])
    assert r.exit_code == 2 and "bogus_setting" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ------------------------------------------------------------------ stream replay size
async def test_replayed_stream_events_fit_max_message_bytes() -> None:
    """A stream replayed after an ambiguous acknowledgement failure is regrouped into events of
    up to 256 KiB, measured before JSON escaping. Before: with max_message_bytes=16 KiB (allowed)
    every replay of a stream longer than 16 KiB was refused (a healthy job answered
    result_too_large); with the default 1 MB, text of control characters (6 bytes each in JSON)
    made 1.4 MB events."""
    from aiokafka.errors import KafkaTimeoutError

    from qworker.worker.publisher import Publisher
    from qworker.worker.stream import StreamCoalescer, StreamSender

    class Producer:
        def __init__(self) -> None:
            self.sent: list[bytes] = []
            self.fail = True

        async def send(self, topic, value=None, key=None, headers=None):
            fut = asyncio.get_running_loop().create_future()
            if self.fail:
                fut.set_exception(KafkaTimeoutError())  # ambiguous: the stream is replayed
            else:
                self.sent.append(value)
                fut.set_result(None)
            return fut

    for limit, piece in ((16_384, "word "), (1_000_000, "\x00" * 100)):
        prod = Producer()
        pub = Publisher(prod, lambda: False, max_message_bytes=limit)  # type: ignore[arg-type]
        sender = StreamSender(pub, "t", StreamCoalescer("j", 0, "r0", 0.0), None)
        text = []
        for i in range(3000):
            sender.coalescer.add(0, piece, [i])
            text.append(piece)
            await sender.flush()
        prod.fail = False
        await sender.settle()  # before: DeliveryRefused (too large)
        from qworker.messages import loads

        evs = [loads(v) for v in prod.sent]
        assert all(e["run_id"] == sender.run_id != "r0" for e in evs)
        assert [e["seq"] for e in evs] == list(range(len(evs)))
        assert "".join(e["text"] for e in evs) == "".join(text)  # a reader reconstructs it exactly
        assert max(len(v) for v in prod.sent) <= limit - 1024


# ------------------------------------------------------------------ cancels
async def test_cancel_stamped_in_the_future_expires_after_its_ttl(monkeypatch) -> None:
    """A cancel record whose timestamp is ahead of this pod's clock (a skewed producer, or a
    CreateTime set by hand) was kept for TTL + skew: a job id cancelled an hour "from now"
    stayed cancelled for an hour and ten minutes on this pod only."""
    from qworker.worker import cancellation
    from qworker.worker.cancellation import CancelRegistry

    now = [time.time()]  # the registry's clock, moved by hand: no race with the machine's speed
    monkeypatch.setattr(cancellation, "time", SimpleNamespace(time=lambda: now[0]))
    reg = CancelRegistry(ttl_s=0.3)
    assert reg.add("x", now[0] + 3600)
    assert "x" in reg
    now[0] += 0.29
    assert "x" in reg
    now[0] += 0.02
    assert "x" not in reg


# ------------------------------------------------------------------ raw fetch parser
def test_rawfetch_agrees_with_aiokafka_on_valid_batches() -> None:
    """Guard (held before the review too): every codec, transactional and control batches, log
    append time, null keys/values/header values, a truncated last batch."""
    from aiokafka import TopicPartition
    from aiokafka.record.default_records import DefaultRecordBatchBuilder
    from aiokafka.record.memory_records import MemoryRecords
    from aiokafka.record.util import calc_crc32c

    from qworker.worker.rawfetch import parse

    rnd = random.Random(7)
    tp = TopicPartition("t", 0)

    def rb(n: int) -> bytes:
        return bytes(rnd.getrandbits(8) for _ in range(n))

    def set_attr(buf: bytearray, bit: int) -> None:
        struct.pack_into(">h", buf, 21, struct.unpack_from(">h", buf, 21)[0] | bit)
        struct.pack_into(">I", buf, 17, calc_crc32c(bytes(buf[21:])))

    for _ in range(150):
        data, base = b"", rnd.randint(0, 1000)
        for _b in range(rnd.randint(1, 4)):
            b = DefaultRecordBatchBuilder(2, rnd.randint(0, 4), rnd.random() < 0.3, rnd.choice([-1, 7]), -1, -1, 1 << 20)
            for i in range(rnd.randint(1, 6)):
                key = None if rnd.random() < 0.3 else rb(rnd.randint(0, 20))
                val = None if rnd.random() < 0.3 else rb(rnd.randint(0, 300))
                hdrs = [("".join(chr(rnd.randint(32, 0x2000)) for _ in range(rnd.randint(0, 5))), None if rnd.random() < 0.3 else rb(rnd.randint(0, 10))) for _ in range(rnd.randint(0, 3))]
                b.append(i * rnd.choice([1, 2]), timestamp=rnd.randint(1, 2**41), key=key, value=val, headers=hdrs)
            buf = bytearray(b.build())
            struct.pack_into(">q", buf, 0, base)
            if rnd.random() < 0.3:
                set_attr(buf, 0x08)  # log append time
            if rnd.random() < 0.15:
                set_attr(buf, 0x20)  # control batch
            data += bytes(buf)
            base += 100
        if rnd.random() < 0.3:
            data = data[: rnd.randint(len(data) - 40, len(data))]
        mr, ref = MemoryRecords(data), []
        while (batch := mr.next_batch()) is not None:
            if not batch.is_control_batch:
                ref += [(r.offset, r.timestamp, r.key, r.value, [(k.encode(), v) for k, v in r.headers]) for r in batch]
        assert [(r.offset, r.timestamp, r.key, r.value, r.raw_headers) for r in parse(tp, data)] == ref


# ------------------------------------------------------------------ through the broker (tiny model)
from .test_defects import RawKey, produce_raw  # noqa: E402
from .test_flow import engines, job, one_torch_thread, started  # noqa: E402,F401 - fixtures
from .conftest import Results, partition_ends, wait_committed  # noqa: E402


async def _produce_to(s, topic: str, per_partition: dict[int, list[tuple[bytes, bytes, list]]]) -> None:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=s.bootstrap_servers, enable_idempotence=False, linger_ms=20)
    await p.start()
    try:
        futs = [await p.send(topic, value=v, key=k, headers=h, partition=part) for part, recs in per_partition.items() for k, v, h in recs]
        await asyncio.gather(*futs)
    finally:
        await p.stop()


async def test_bad_header_on_one_partition_loses_no_record_of_another(topics, results: Results, engines) -> None:
    """aiokafka's getmany drains partition after partition and advances each one's position;
    when a later partition raises (a header key that is not UTF-8), the records already drained
    from the earlier ones are dropped with the exception, positions moved past them. The worker
    then skipped those jobs for good and committed past them (unanswered, committed) whenever one
    fetch held the bad record and other partitions' jobs. Polling one partition at a time
    (and waiting for data with max_records=1) leaves nothing drained to drop."""
    bad_p = 3
    eng = await engines()
    ids: set[str] = set()
    # two rounds, each a fresh worker whose first fetch holds every partition's records (a round
    # where the bad partition comes first in aiokafka's buffer loses nothing, even before the fix)
    for rnd in range(2):
        good = {p: [(f"j{rnd}{p}-{i}".encode(), job(f"j{rnd}{p}-{i}", max_tokens=1).model_dump_json().encode(), []) for i in range(3)] for p in range(4) if p != bad_p}
        await _produce_to(topics, topics.jobs_topic, good)
        bad = job(f"bad{rnd}", max_tokens=1).model_dump_json().encode()
        await produce_raw(topics, topics.jobs_topic, b"bad", bad, [(RawKey(b"\xff-bad"), b"v")], partition=bad_p)
        ids |= {k.decode() for recs in good.values() for k, _, _ in recs}
        w = await started(topics, eng)
        try:
            await results.wait(lambda: ids <= set(results.completions) and len(results.dlq) == rnd + 1, 20, "every good job answered, the bad one dead-lettered")
            await wait_committed(topics)
            assert w.loops_alive()
        finally:
            await w.stop()


async def _recreate_topics(s, partitions: int) -> None:
    """Create the topics again on a broker that is still coming up."""
    from qworker.worker.client import create_topics

    deadline = time.monotonic() + 30
    while True:
        try:
            await create_topics(s, partitions=partitions)
            return
        except Exception:  # noqa: BLE001 - the broker is still coming up
            assert time.monotonic() < deadline
            await asyncio.sleep(0.5)


async def test_jobs_after_the_log_starts_over_are_not_mistaken_for_refetches(engines, tmp_path) -> None:
    """A broker that comes back without its data (memory storage; in real Kafka a topic deleted
    and re-created, or a log truncated by an unclean leader election) numbers new records from 0
    again. The worker kept each partition's "seen up to" mark, so every new job below it was
    taken for a refetch of one it had answered: ignored, never answered, then committed past."""
    from qworker.broker import start_broker, stop_broker
    from qworker.worker.client import create_topics, submit

    from .conftest import make_settings

    broker = start_broker(log_dir=tmp_path)
    try:
        s = make_settings(broker.bootstrap)
        await create_topics(s, partitions=4)
        eng = await engines()
        r = await Results(s).start()
        w = await started(s, eng)
        try:
            await submit(s, [job(f"a{i}", max_tokens=1) for i in range(12)])
            await r.wait(lambda: len(r.completions) == 12, 30, "the first jobs")
            await wait_committed(s)
            await r.stop()
            await asyncio.to_thread(broker.restart)  # memory storage: topics, records and offsets gone
            await _recreate_topics(s, partitions=4)  # the operator re-creates the topics
            r = await Results(s).start()
            await submit(s, [job(f"b{i}", max_tokens=1) for i in range(4)])
            await r.wait(lambda: {f"b{i}" for i in range(4)} <= set(r.completions), 40, "the jobs after the restart")
        finally:
            await w.stop(drain_timeout_s=5)
            await r.stop()
    finally:
        stop_broker(broker)


def _jobs_on(partition: int, ids: list[str]) -> dict[int, list[tuple[bytes, bytes, list]]]:
    return {partition: [(i.encode(), job(i, max_tokens=1).model_dump_json().encode(), []) for i in ids]}


async def _commit_as_group(s, offsets: dict[int, int]) -> None:
    """Commit for the worker's group, as a previous owner of these partitions would have."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=s.bootstrap_servers, group_id=s.group_id, enable_auto_commit=False)
    await c.start()
    try:
        c.assign([TopicPartition(s.jobs_topic, p) for p in offsets])
        await c.commit({TopicPartition(s.jobs_topic, p): o for p, o in offsets.items()})
    finally:
        await c.stop()


async def test_a_log_replaced_while_the_worker_was_frozen_is_read_from_its_start(engines, tmp_path) -> None:
    """helper-71, helper-76: a broker that restarted without its data while the worker was
    stopped (a pod frozen, a slow reconnect) and whose new log grew past the worker's position
    before the worker fetched again. Its offsets look continuous: the worker fetched on from its
    old position, and its next commit stepped over the new log's first jobs (never answered).
    Now every partition is suspect after a broken connection until the log still holds the
    record read there last (partition 0), or, for a partition not read yet in this ownership,
    the record before the group's offset a previous owner left (partition 1); here each holds
    another job, so both partitions are read from their starts."""
    import threading

    from qworker.broker import start_broker, stop_broker
    from qworker.worker.client import create_topics

    from .conftest import make_settings

    broker = start_broker(log_dir=tmp_path)
    try:
        s = make_settings(broker.bootstrap)
        await create_topics(s, partitions=2)
        await _produce_to(s, s.jobs_topic, _jobs_on(1, [f"old{i}" for i in range(10)]))
        await _commit_as_group(s, {1: 10})  # answered by a previous owner
        eng = await engines()
        r = await Results(s).start()
        w = await started(s, eng)
        try:
            await _produce_to(s, s.jobs_topic, _jobs_on(0, [f"a{i}" for i in range(3)]))
            await r.wait(lambda: len(r.completions) == 3, 30, "the first jobs")
            await wait_committed(s, partitions=2)

            def restart_and_refill() -> None:  # memory storage: topics, records and offsets gone
                broker.restart()

                async def refill() -> None:  # the operator re-creates the topic; producers resubmit at once
                    await _recreate_topics(s, partitions=2)
                    await _produce_to(s, s.jobs_topic, {**_jobs_on(0, [f"b{i}" for i in range(6)]), **_jobs_on(1, [f"c{i}" for i in range(14)])})

                asyncio.run(refill())

            # run on another thread while this loop, the worker's, is blocked: a frozen pod
            t = threading.Thread(target=restart_and_refill)
            t.start()
            t.join()
            await r.stop()
            r = await Results(s).start()
            want = {f"b{i}" for i in range(6)} | {f"c{i}" for i in range(14)}
            await r.wait(lambda: want <= set(r.completions), 60, "every job of the new log")
            await wait_committed(s, partitions=2)
        finally:
            await w.stop(drain_timeout_s=5)
            await r.stop()
    finally:
        stop_broker(broker)


async def test_a_log_that_kept_its_records_vouches_for_them_and_commits_resume(topics, results: Results, engines) -> None:
    """helper-76: the check above asked the broker with a zero-wait fetch, which Tansu answers
    without the partition, so after any broken connection a partition was never committed
    again (its next owner reran everything read since). A log that kept its records vouches for
    them: commits resume, nothing is read twice."""
    from qworker.worker.client import submit

    eng = await engines()
    w = await started(topics, eng)
    try:
        await submit(topics, [job(f"a{i}", max_tokens=1) for i in range(6)])
        await results.wait(lambda: len(results.completions) == 6, 30, "the first jobs")
        await wait_committed(topics)
        w.tracker.suspect_all()  # what a broken connection does
        assert any(w.tracker.witness(tp) for tp in w.tracker.partitions())
        await submit(topics, [job(f"b{i}", max_tokens=1) for i in range(6)])
        await results.wait(lambda: len(results.completions) == 12, 30, "the jobs after")
        await wait_committed(topics)
        assert not any(w.tracker.witness(tp) for tp in w.tracker.partitions())
        assert all(len(v) == 1 for v in results.completions.values()) and w.stats.refetched == 0
    finally:
        await w.stop()


@pytest.mark.parametrize("topic_ids, gap_s", [(True, 0.0), (False, 2.0)], ids=["topic ids", "no topic ids"])
async def test_a_topic_deleted_and_recreated_under_a_running_worker_is_read_from_its_start(topics, results: Results, engines, monkeypatch,
                                                                                           topic_ids: bool, gap_s: float) -> None:
    """helper-78: the jobs topic deleted and re-created (same partitions) on a broker that stays
    up, while the worker runs, and refilled past the worker's position at once. Tansu answers
    fetches of a deleted topic with an empty log and no error, so no metadata changed and no
    connection broke: the worker read on from its old position and committed over the new
    log's first jobs. Now the topic's id is asked before each commit (a new one makes every
    partition suspect, and the record check finds the new log), which catches even a topic
    refilled between two fetches; on a broker without topic ids, a fetch that shows the log
    shorter than what was read does the same, given a moment between delete and create."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from qworker.worker import topic_ids as topic_ids_mod

    if not topic_ids:
        async def unsupported(consumer, topic):
            raise topic_ids_mod.TopicIdsUnsupported("as Kafka before 2.8")

        monkeypatch.setattr(topic_ids_mod, "topic_id", unsupported)
    eng = await engines()
    w = await started(topics, eng)
    admin = AIOKafkaAdminClient(bootstrap_servers=topics.bootstrap_servers)
    await admin.start()
    try:
        await _produce_to(topics, topics.jobs_topic, _jobs_on(0, [f"a{i}" for i in range(6)]))
        await results.wait(lambda: len(results.completions) == 6, 30, "the first jobs")
        await wait_committed(topics)
        await admin.delete_topics([topics.jobs_topic])
        await asyncio.sleep(gap_s)  # the worker fetches the deleted topic meanwhile
        await admin.create_topics([NewTopic(topics.jobs_topic, 4, 1)])
        await _produce_to(topics, topics.jobs_topic, _jobs_on(0, [f"b{i}" for i in range(9)]))
        await results.wait(lambda: {f"b{i}" for i in range(9)} <= set(results.completions), 60, "every job of the new topic")
        await wait_committed(topics)
    finally:
        await admin.close()
        await w.stop()



async def test_a_log_on_object_storage_vouches_for_its_records_after_a_restart(engines, tmp_path) -> None:
    """helper-80: a broker on S3 storage restarted (its data kept) answered the check's short
    fetch with no records before it had read them back, so the check never passed and the
    worker stopped committing for good (its next owner would rerun everything since). The check
    now waits for a record as a consumer's fetch does; commits resume."""
    from qworker.broker import start_broker, stop_broker
    from qworker.worker.client import create_topics, submit

    from .conftest import make_settings

    broker = start_broker(s3=True, log_dir=tmp_path)
    try:
        s = make_settings(broker.bootstrap)
        await create_topics(s, partitions=2)
        eng = await engines()
        r = await Results(s).start()
        w = await started(s, eng)
        try:
            await submit(s, [job(f"a{i}", max_tokens=1) for i in range(6)])
            await r.wait(lambda: len(r.completions) == 6, 30, "the first jobs")
            await wait_committed(s, partitions=2)
            await r.stop()
            await asyncio.to_thread(broker.restart)  # S3 storage: the same records, the same topic
            from aiokafka import TopicPartition

            from qworker.worker import rawfetch

            held = {TopicPartition(s.jobs_topic, p): e for p, e in (await partition_ends(s, partitions=2)).items() if e}
            for tp, end in held.items():  # what the check reads: every record still there
                for off in range(end):
                    got = await rawfetch.record_at(w.consumer, tp, off)
                    assert isinstance(got, rawfetch.RawRecord) and got.offset == off, (tp, off, got)
            r = await Results(s).start()
            await submit(s, [job(f"b{i}", max_tokens=1) for i in range(6)])
            await r.wait(lambda: {f"b{i}" for i in range(6)} <= set(r.completions), 60, "the jobs after the restart")
            await wait_committed(s, timeout=30, partitions=2)
            assert w.stats.refetched == 0 and all(len(v) == 1 for v in r.completions.values()), "nothing read twice"
        finally:
            await w.stop(drain_timeout_s=5)
            await r.stop()
    finally:
        stop_broker(broker)
