"""Pure units: offsets, admission, decoding, coalescing, config, schemas."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import orjson
import pytest

from qworker import schemas_gen
from qworker.config import WorkerSettings, parse_size
from qworker.messages import MESSAGE_TYPES, Job
from qworker.worker.admission import Admission, PendingQueue
from qworker.worker.cancellation import CancelRegistry, parse_cancel
from qworker.worker.decode import Invalid, Unparseable, Valid, decode
from qworker.worker.offsets import OffsetTracker
from qworker.worker.stream import StreamCoalescer


def test_offsets_commit_first_unfinished() -> None:
    t: OffsetTracker[str] = OffsetTracker()
    assert t.committable("p") is None
    for o in (5, 6, 7, 9):  # 8 missing: a gap (compaction / txn marker)
        assert t.add("p", o)
    assert t.committable("p") == 5
    t.done("p", 6)
    t.done("p", 7)
    assert t.committable("p") == 5  # 5 still running: nothing past it may be committed
    t.done("p", 5)
    assert t.committable("p") == 9
    t.done("p", 9)
    assert t.committable("p") == 10
    assert t.to_commit() == {"p": 10}
    t.mark_committed({"p": 10})
    assert t.to_commit() == {}
    assert not t.add("p", 7)  # refetched after a rebalance: not started twice
    t.done("q", 3)  # unknown partition: ignored
    t.drop("p")
    assert t.committable("p") is None


def test_offsets_many_partitions_independent() -> None:
    t: OffsetTracker[int] = OffsetTracker()
    t.add(0, 0)
    t.add(1, 0)
    t.done(1, 0)
    assert t.to_commit() == {0: 0, 1: 1}


@dataclass
class J:
    prompt_len: int
    max_new_tokens: int
    generated: int = 0


@dataclass
class Cap:
    free_tokens: int
    num_running: int = 0
    num_waiting: int = 0
    total_tokens: int = 1000


def test_admission_capacity_and_bounds() -> None:
    a = Admission(max_waiting=4, reserve_tokens=100)
    assert a.can_admit(J(5000, 10), Cap(0), [])  # idle engine: always one
    assert a.can_admit(J(100, 50), Cap(500), [J(100, 100, generated=1)])  # 500 - 99 >= 150
    assert not a.can_admit(J(100, 50), Cap(250), [J(100, 1000, generated=1), J(10, 300, 50)])  # 250 - (99 + 50) < 150
    assert not a.can_admit(J(1, 1), Cap(10**6, num_waiting=4), [J(1, 1, 1)])
    assert not a.can_admit(J(1, 1), Cap(10**6), [J(1, 1)] * 4)  # 4 admitted, none started yet
    assert not a.can_admit(J(100, 10), Cap(300), [J(1, 1, 1), J(250, 10, 0)])  # unseen prompt charged
    assert a.should_pause(4, paused=False) and not a.should_pause(3, paused=False)
    assert a.should_pause(3, paused=True) and not a.should_pause(2, paused=True)


def test_pending_queue_priority_fifo_remove() -> None:
    q: PendingQueue[str] = PendingQueue()
    for prio, name in [(0, "a"), (-1, "b"), (0, "c"), (5, "d")]:
        q.push(prio, name)
    assert q.remove("c") and not q.remove("zz")
    assert len(q) == 3
    assert [q.pop() for _ in range(3)] == ["b", "a", "d"]
    assert q.peek() is None and len(q) == 0


def test_decode_verdicts() -> None:
    assert isinstance(decode(b'{"id":"x","prompt":"hi"}'), Valid)
    for raw, code in [(b"", "empty"), (b"{nope", "not_json"), (b"[1,2]", "not_object"), (b'{"prompt":"hi"}', "no_id"), (b'{"id":5}', "no_id"), (b'{"id":"\\ud800"}', "no_id")]:
        d = decode(raw)
        assert isinstance(d, Unparseable) and d.code == code, (raw, d)
    for raw in [
        b'{"id":"x"}',
        b'{"id":"x","prompt":"a","messages":[{"role":"user","content":"b"}]}',
        b'{"id":"x","prompt":"a","sampling":{"max_tokens":"5"}}',
        b'{"id":"x","prompt":"a","sampling":{"max_tokens":0}}',
        b'{"id":"x","prompt":"a","extra":1}',
        b'{"id":"x","prompt":"a","priority":1e400}',
        b'{"id":"x","prompt":"a","sampling":{"seed":123456789012345678901234567890}}',
        b'{"id":"x","prompt":"a","stream":1}',
    ]:
        d = decode(raw)
        assert isinstance(d, Invalid) and d.job_id == "x" and d.message, raw


def test_coalescer_seq_and_interval() -> None:
    c = StreamCoalescer("j", 3, "r", interval_s=1.0)
    c.add(0, "he", [1, 2])
    assert c.due(now=100.0)
    evs = c.take(now=100.0)
    assert [(e.seq, e.text, e.attempt) for e in evs] == [(0, "he", 3)]
    c.add(0, "l", [3])
    c.add(1, "x", [9])
    c.add(0, "lo", [4])
    assert not c.due(now=100.5) and c.due(now=101.0)
    evs = c.take(now=101.0)
    assert [(e.index, e.seq, e.text, e.token_ids) for e in evs] == [(0, 1, "llo", [3, 4]), (1, 2, "x", [9])]
    assert c.take() == []


def test_cancel_registry_and_parse() -> None:
    r = CancelRegistry(ttl_s=60, max_size=2)
    r.add("a")
    r.add("b")
    r.add("c")
    assert "a" not in r and "b" in r and "c" in r
    assert parse_cancel(None, b'{"job_id":"z"}') == "z"
    assert parse_cancel(b"k", b"garbage") == "k"
    assert parse_cancel(None, b"garbage") is None


def test_config_env_and_overrides() -> None:
    env = {"QWORKER_BOOTSTRAP_SERVERS": "k:9092", "QWORKER_ENABLE_IDEMPOTENCE": "false", "QWORKER_KV_CACHE_MEMORY": "1GiB", "QWORKER_DRAIN_TIMEOUT_S": "7", "QWORKER_JOBS_TOPIC": "j"}
    s = WorkerSettings.from_env(env, drain_timeout_s=9)
    assert (s.bootstrap_servers, s.enable_idempotence, s.kv_cache_memory, s.drain_timeout_s, s.jobs_topic) == ("k:9092", False, 2**30, 9.0, "j")
    d = WorkerSettings.from_env({})
    assert (d.group_id, d.jobs_topic, d.tokens_topic, d.completions_topic, d.dlq_topic, d.cancel_topic, d.drain_timeout_s, d.http_port, d.enable_idempotence) == (
        "qworker", "qworker.jobs", "qworker.tokens", "qworker.completions", "qworker.dlq", "qworker.cancel", 120.0, 8080, True)
    assert d.producer_options()["acks"] == "all" and d.consumer_options()["enable_auto_commit"] is False
    sasl = WorkerSettings.from_env({"QWORKER_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "QWORKER_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256", "QWORKER_KAFKA_SASL_USERNAME": "u", "QWORKER_KAFKA_SASL_PASSWORD": "p"})
    k = sasl.kafka_common()
    assert (k["security_protocol"], k["sasl_mechanism"], k["sasl_plain_username"]) == ("SASL_PLAINTEXT", "SCRAM-SHA-256", "u")
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("2G") == 2 * 10**9
    with pytest.raises(ValueError):
        WorkerSettings.from_env({"QWORKER_KAFKA_SECURITY_PROTOCOL": "BOGUS"})


def test_schemas_match_models() -> None:
    assert schemas_gen.diff() == [], "schemas/ is stale: run `make schemas` (python -m qworker.schemas_gen)"


def test_examples_validate() -> None:
    for name, data in schemas_gen.examples().items():
        MESSAGE_TYPES[name.split(".")[0]].model_validate_json(orjson.dumps(data))
    assert Job.model_validate_json(orjson.dumps(schemas_gen.examples()["job.chat"])).messages


@pytest.mark.parametrize("job,schema_ok,worker_ok", [
    ({"id": "a", "prompt": "x", "sampling": {"logit_bias": {"abc": 1}}}, False, False),
    ({"id": "a", "prompt": "x", "sampling": {"logit_bias": {"0123": 1}}}, False, False),
    ({"id": "a", "prompt": "x", "sampling": {"logit_bias": {"123": 1}}}, True, True),
    ({"id": "a", "prompt": "x", "sampling": {"max_tokens": 4.0, "n": 2.0}, "prompt_token_ids": None}, True, True),
    ({"id": "a", "prompt_token_ids": [1.0, 2]}, True, True),
    ({"id": "a", "prompt": "x", "sampling": {"max_tokens": 4.5}}, False, False),
    ({"id": "a", "prompt": "x", "prompt_token_ids": [1]}, False, False),
    ({"id": "a", "prompt": None, "messages": None}, False, False),
    ({"id": "a", "messages": [{"role": "user", "content": "hi"}], "prompt": None}, True, True),
])
def test_the_job_schema_and_the_worker_agree(job, schema_ok, worker_ok) -> None:
    """helper-85: the published schema accepted jobs the worker refused (logit_bias keys that are
    not token ids, max_tokens 4.0, a prompt and prompt_token_ids together)."""
    import jsonschema
    from pydantic import ValidationError

    validator = jsonschema.Draft202012Validator(schemas_gen.schema_for("job"))
    assert validator.is_valid(job) is schema_ok
    try:
        Job.model_validate(orjson.loads(orjson.dumps(job)))  # as the worker's decode does
        accepted = True
    except ValidationError:
        accepted = False
    assert accepted is worker_ok


def test_coalescer_restart_replays_everything_taken() -> None:
    c = StreamCoalescer("j", 0, "r1", interval_s=0.0)
    c.add(0, "he", [1, 2])
    c.add(1, "x", [9])
    c.take()
    c.add(0, "llo", [3])
    c.take()
    c.add(0, "!", [4])  # still buffered: goes out with the next take, after the replay
    replay = c.restart("r2")
    assert [(e.run_id, e.index, e.seq, e.text, e.token_ids) for e in replay] == [("r2", 0, 0, "hello", [1, 2, 3]), ("r2", 1, 1, "x", [9])]
    assert [(e.run_id, e.seq, e.text) for e in c.take()] == [("r2", 2, "!")]


def test_cancel_registry_ttl_from_the_record_time() -> None:
    import time

    r = CancelRegistry(ttl_s=10)
    assert not r.add("old", at=time.time() - 11) and "old" not in r  # expired before it was read
    assert r.add("new", at=time.time() - 9) and "new" in r


def test_metadata_bounds() -> None:
    from qworker.messages import MAX_METADATA_BYTES, MAX_METADATA_DEPTH

    def nest(n: int) -> dict:
        d: dict = {}
        for _ in range(n - 1):
            d = {"a": d}
        return d

    ok = {"id": "x", "prompt": "p", "metadata": nest(MAX_METADATA_DEPTH)}
    assert isinstance(decode(orjson.dumps(ok)), Valid)
    for meta in (nest(MAX_METADATA_DEPTH + 1), nest(300), {"a": [[[[]]]] * 2, "b": nest(MAX_METADATA_DEPTH)}, {"s": "x" * MAX_METADATA_BYTES}):
        d = decode(json.dumps({"id": "x", "prompt": "p", "metadata": meta}).encode())
        assert isinstance(d, Invalid) and "metadata" in d.message and d.metadata is None, meta


async def test_publisher_never_retries_a_permanent_error() -> None:
    from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError

    from qworker.worker.publisher import DeliveryRefused, Publisher

    class Producer:
        calls = 0

        async def send(self, topic, value=None, key=None, headers=None):
            self.calls += 1
            if self.calls == 1:
                raise KafkaTimeoutError()  # a full buffer: transient, retried
            raise MessageSizeTooLargeError()  # the broker's limit: permanent

    p = Producer()
    pub = Publisher(p, lambda: False, max_message_bytes=100_000)  # type: ignore[arg-type]
    with pytest.raises(DeliveryRefused) as e:
        await pub.deliver("t", "k", b"v")
    assert e.value.too_large and p.calls == 2
    with pytest.raises(DeliveryRefused):  # over our own limit: refused before any send
        await pub.deliver("t", "k", b"x" * 100_001)
    assert p.calls == 2


def test_rawfetch_parses_what_aiokafka_cannot() -> None:
    from aiokafka import TopicPartition
    from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy

    from qworker.worker.rawfetch import parse
    from tests.worker.kafka_batches import RawKey

    data = b""
    for codec, base in ((0, 0), (4, 2)):  # plain, then zstd
        b = _DefaultRecordBatchBuilderPy(2, codec, 0, -1, -1, -1, 1 << 20)
        b.append(0, 1000, b"k", b"v", [("h", None)])
        b.append(1, 1001, None, None, [(RawKey(b"\xff\xfe"), b"\x00")])
        buf = b.build()
        buf[0:8] = base.to_bytes(8, "big")  # the broker assigns the base offset
        data += bytes(buf)
    recs = parse(TopicPartition("t", 0), data + data[:20])  # a truncated batch at the end is skipped
    assert [(r.offset, r.timestamp, r.key, r.value, r.raw_headers, r.decodable) for r in recs] == [
        (0, 1000, b"k", b"v", [(b"h", None)], True), (1, 1001, None, None, [(b"\xff\xfe", b"\x00")], False)] * 1 + [
        (2, 1000, b"k", b"v", [(b"h", None)], True), (3, 1001, None, None, [(b"\xff\xfe", b"\x00")], False)]


def test_coalescer_restart_splits_a_long_stream() -> None:
    c = StreamCoalescer("j", 0, "r1", interval_s=0.0)
    for i in range(10):
        c.add(0, "ab", [i, i])
        c.take()
    replay = c.restart("r2", max_event_bytes=60)  # 2 bytes of text + 24 for two ids per piece: two pieces per event
    assert [e.seq for e in replay] == [0, 1, 2, 3, 4]
    assert "".join(e.text for e in replay) == "ab" * 10 and sum((e.token_ids for e in replay), []) == [i for i in range(10) for _ in (0, 1)]


def test_speculative_config_setting_reaches_the_engine_and_bad_values_name_the_variable() -> None:
    from pydantic import ValidationError

    from qworker.engine.config import EngineConfig
    from qworker.engine.spec_decode.config import SpeculativeConfig

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4, "policy": "auto"}
    s = WorkerSettings.from_env({"QWORKER_SPECULATIVE_CONFIG": json.dumps(spec)})
    cfg = s.engine_config()
    assert cfg["speculative_config"] == spec
    parsed = EngineConfig(model="m", **cfg).speculative_config
    assert isinstance(parsed, SpeculativeConfig) and parsed.num_speculative_tokens == 3 and parsed.policy == "auto"
    assert "speculative_config" not in WorkerSettings.from_env({"QWORKER_SPECULATIVE_CONFIG": " "}).engine_config()
    assert "speculative_config" not in WorkerSettings.from_env({}).engine_config()
    for bad in ("{not json", "[1, 2]", '{"method": "eagle"}', '{"num_speculative_tokens": 0}', '{"k": 3}'):
        with pytest.raises(ValidationError) as e:
            WorkerSettings.from_env({"QWORKER_SPECULATIVE_CONFIG": bad})
        assert "QWORKER_SPECULATIVE_CONFIG" in WorkerSettings.explain(e.value), bad


def test_kept_partitions_check_has_one_deadline_for_all_partitions(monkeypatch) -> None:
    """A broker that never answers OffsetFetch holds a rebalance for one deadline, not one per
    kept partition (it was 5 s each, one after the other); unchecked partitions are kept as is."""
    import asyncio
    import time

    from aiokafka.structs import TopicPartition

    from qworker.worker import app as app_mod
    from qworker.worker import partitions as partitions_mod

    class Stalled:
        calls = 0

        async def committed(self, tp):
            Stalled.calls += 1
            await asyncio.sleep(3600)

    # one deadline takes 1 s, one per partition 8 s: the bound below leaves 3 s for a slow machine
    monkeypatch.setattr(partitions_mod, "KEPT_CHECK_TIMEOUT_S", 1.0)
    w = app_mod.Worker(WorkerSettings())
    w.consumer = Stalled()
    tps = {TopicPartition("jobs", p) for p in range(8)}
    for tp in tps:
        w.tracker.add(tp, 0)
        w.tracker.done(tp, 0)
        w.tracker.mark_committed({tp: 1})
    t0 = time.monotonic()
    asyncio.run(w.partitions.check_kept(tps))
    elapsed = time.monotonic() - t0
    assert elapsed < 8 * 1.0 / 2, f"{elapsed:.2f} s: the deadline was per partition"
    assert sorted(tp.partition for tp in w.tracker.partitions()) == list(range(8)), "unchecked partitions are kept"


def test_a_partition_read_but_never_committed_starts_afresh_when_the_group_has_no_offset() -> None:
    """helper-50: a memory-storage broker restarted before our first commit on a partition. The
    check skipped partitions we had never committed, so our "seen up to 8" mark stayed: the new
    log's records 0-4 were taken for refetches (never answered) and the next commit round
    committed 8 over them. A group with no offset now starts such a partition afresh; one with an
    offset (a new owner's start, our own reads above it) keeps it."""
    import asyncio

    from aiokafka.structs import TopicPartition

    from qworker.worker import app as app_mod
    from qworker.worker.jobs import JobState
    from qworker.worker.partitions import DETACHED

    class Group:
        offsets = {TopicPartition("jobs", 1): 3}

        async def committed(self, tp):
            return self.offsets.get(tp)

    w = app_mod.Worker(WorkerSettings())
    w.consumer = Group()
    reset, kept = TopicPartition("jobs", 0), TopicPartition("jobs", 1)
    for tp, first in ((reset, 0), (kept, 3)):
        for off in range(first, 8):
            assert w.tracker.add(tp, off)
        for off in range(first, 7):
            w.tracker.done(tp, off)  # answered, not committed yet; 7 still running
    running = JobState(job=Job(id="running", prompt="x"), tp=reset, offset=7, produced_at=0.0, received_at=0.0)
    w.registry.jobs["running"] = running
    asyncio.run(w.partitions.check_kept({reset, kept}))
    assert reset not in w.tracker.partitions() and running.tp == DETACHED
    assert w.tracker.add(reset, 0), "the new log's first record must count as new"
    assert w.tracker.committable(kept) == 7 and not w.tracker.add(kept, 5)


def test_a_log_that_shrank_under_us_starts_afresh_before_any_commit(monkeypatch) -> None:
    """helper-50 again: with the broker's group state gone too, the commit round after the
    restart wrote our stale "read up to 8" into the new log (the broker took it) before any
    rebalance could compare offsets, and the new records 0-4 were never fetched or answered.
    A fetch's high watermark below what we read now withholds the partition's commits; if it stays
    below (a failover's new leader can trail for a moment: that must not replay the partition),
    the partition starts afresh: from the group's offset where that lies inside the new log (a
    truncated one), else from its beginning."""
    monkeypatch.setattr("qworker.worker.topic_ids.topic_id", _same_topic_id)
    import asyncio
    import time

    from aiokafka.structs import TopicPartition

    from qworker.worker import app as app_mod
    from qworker.worker.jobs import JobState
    from qworker.worker.partitions import DETACHED

    monkeypatch.setattr("qworker.worker.log_resets.SHRUNK_CONFIRM_S", 0.3)
    reset, truncated, fine = (TopicPartition("jobs", p) for p in range(3))

    class Consumer:
        ends = {reset: 5, truncated: 6, fine: 12}
        group = {truncated: 4}
        commits: list = []
        rewound: list = []
        sought: list = []

        def assignment(self):
            return set(self.ends)

        def highwater(self, tp):
            return self.ends[tp]

        async def committed(self, tp):
            return self.group.get(tp)

        async def seek_to_beginning(self, *tps):
            self.rewound += tps

        def seek(self, tp, offset):
            self.sought.append((tp, offset))

        async def commit(self, offsets):
            self.commits.append(dict(offsets))

    w = app_mod.Worker(WorkerSettings())
    w.consumer = c = Consumer()
    for tp in c.ends:
        for off in range(8):
            w.tracker.add(tp, off)
        for off in range(7):
            w.tracker.done(tp, off)
    running = JobState(job=Job(id="running", prompt="x"), tp=reset, offset=7, produced_at=0.0, received_at=0.0)
    w.registry.jobs["running"] = running

    async def rounds() -> None:
        await w.partitions.commit()  # both short logs seen: withheld, not yet believed
        assert c.commits == [{fine: 7}] and not c.rewound and not c.sought and running.tp == reset
        c.ends[truncated] = 9  # a leader that caught up: an ordinary partition again
        await w.partitions.commit()
        assert c.commits[-1] == {truncated: 7}
        c.ends[truncated] = 6
        await w.partitions.commit()
        time.sleep(0.35)
        await w.partitions.commit()
        # believed now; the poll loop starts them afresh between two fetches, not the commit loop
        assert not c.rewound and not c.sought and running.tp == reset
        await w.partitions.commit()
        await w.partitions.resets.restart_due()

    asyncio.run(rounds())
    assert c.rewound == [reset] and c.sought == [(truncated, 4)] and running.tp == DETACHED
    assert all(reset not in done for done in c.commits), "nothing of the reset log is committed"
    assert w.tracker.add(reset, 0) and w.tracker.add(truncated, 4), "the new logs' records count as new"



async def _same_topic_id(consumer, topic: str) -> bytes:
    """The jobs topic's id, as a broker that kept the topic answers (see LogResets.same_topic)."""
    return b"t" * 16


class _RecordingConsumer:
    """What the log checks call on the jobs consumer; records seeks to the beginning and commits."""

    def __init__(self, partitions) -> None:
        from types import SimpleNamespace

        self.partitions, self.commits, self.rewound, self.metadata_updates = set(partitions), [], [], []
        self._client = SimpleNamespace(force_metadata_update=lambda: self.metadata_updates.append(1))

    def assignment(self):
        return set(self.partitions)

    def highwater(self, tp):
        return 100

    async def seek_to_beginning(self, *tps):
        self.rewound += tps

    async def commit(self, offsets):
        self.commits.append(dict(offsets))


def test_a_broken_connection_withholds_commits_until_the_log_still_holds_what_was_read(monkeypatch) -> None:
    """helper-71: a broker that came back with a new log grown past our position (memory storage
    restarted; a pod frozen through it) looks continuous, and our next commit stepped over the
    new log's first jobs. After a broken connection every partition is suspect: it is committed
    again only once the log holds the record read last before the break (the witness) at its
    offset. Another record there, or none in a log that reaches past it, restarts the partition
    from the log's start (from the poll loop, between two fetches); a log not reaching it yet, or
    a broker that cannot be asked, keeps it suspect and uncommitted."""
    monkeypatch.setattr("qworker.worker.topic_ids.topic_id", _same_topic_id)
    import asyncio

    from aiokafka.errors import KafkaConnectionError
    from aiokafka.structs import TopicPartition

    from qworker.worker import app as app_mod
    from qworker.worker import rawfetch
    from qworker.worker.jobs import JobState
    from qworker.worker.offsets import fingerprint
    from qworker.worker.partitions import DETACHED

    same, replaced, short, gone, down = (TopicPartition("jobs", p) for p in range(5))

    def rec(tp, off, ts):
        return rawfetch.RawRecord(tp.topic, tp.partition, off, ts, b"k%d" % off, b"v%d" % off, [])

    logs = {same: rec(same, 3, 1000), replaced: rec(replaced, 3, 2000), short: None, gone: "offset 3 lies below the log's start"}

    async def record_at(consumer, tp, offset):
        assert offset == 3, "the witness is the last record read before the break"
        if tp == down:
            raise KafkaConnectionError("no broker")
        return logs[tp]

    monkeypatch.setattr(rawfetch, "record_at", record_at)

    w = app_mod.Worker(WorkerSettings())
    w.consumer = c = _RecordingConsumer({same, replaced, short, gone, down})
    tps = sorted(c.assignment(), key=lambda tp: tp.partition)
    for tp in tps:
        for off in range(4):
            w.tracker.add(tp, off, fingerprint(1000, b"k%d" % off, b"v%d" % off))
            w.tracker.done(tp, off)
    running = JobState(job=Job(id="running", prompt="x"), tp=replaced, offset=5, produced_at=0.0, received_at=0.0)
    w.registry.jobs["running"] = running

    async def rounds() -> None:
        await w.partitions.commit()
        assert c.commits == [{tp: 4 for tp in tps}]
        w.tracker.suspect_all()  # a connection broke
        w.tracker.suspect_all()  # and again: the first witness stays
        for tp in tps:  # read since, maybe from a new log; a record of unknown identity changes no witness
            w.tracker.add(tp, 4, fingerprint(5000, b"new", b"new"))
            w.tracker.add(tp, 5)
            w.tracker.done(tp, 4)
            w.tracker.done(tp, 5)
        await w.partitions.commit()
        assert c.commits[-1] == {same: 6}, "only the log that still holds the witness is committed"
        assert not c.rewound and running.tp == replaced, "the commit loop itself seeks nothing"
        await w.partitions.resets.restart_due()
        assert sorted(tp.partition for tp in c.rewound) == [replaced.partition, gone.partition]
        assert running.tp == DETACHED
        await w.partitions.commit()
        assert len(c.commits) == 2, "a short log and an unreachable broker stay suspect"
        logs[short] = rec(short, 3, 1000)  # the trailing leader caught up
        await w.partitions.commit()
        assert c.commits[-1] == {short: 6}

    asyncio.run(rounds())
    assert w.tracker.add(replaced, 0) and w.tracker.add(gone, 0), "the new logs' records count as new"


def test_a_partition_not_read_yet_is_checked_by_the_record_before_the_groups_offset(monkeypatch) -> None:
    """helper-76: a partition assigned at a previous owner's offset 10 and not read yet had no
    witness; frozen through a memory broker's restart whose new log grew past 10, the worker
    fetched on from 10 and committed over the new log's first ten jobs. At assignment it now
    takes the record before the group's offset as its baseline, which a broken connection makes
    its witness until a record of it is read."""
    monkeypatch.setattr("qworker.worker.topic_ids.topic_id", _same_topic_id)
    import asyncio

    from aiokafka.structs import TopicPartition

    from qworker.worker import app as app_mod
    from qworker.worker import rawfetch
    from qworker.worker.offsets import fingerprint

    unread, fresh, slow = (TopicPartition("jobs", p) for p in range(3))
    log = {9: rawfetch.RawRecord("jobs", 0, 9, 1000, b"k9", b"v9", [])}
    asked = []

    async def record_at(consumer, tp, offset):
        asked.append((tp.partition, offset))
        if tp == slow:
            await asyncio.sleep(3600)
        return log.get(offset)

    monkeypatch.setattr(rawfetch, "record_at", record_at)
    monkeypatch.setattr("qworker.worker.log_resets.CHECK_TIMEOUT_S", 0.5)

    class Consumer(_RecordingConsumer):
        group = {unread: 10, fresh: None, slow: 4}

        async def committed(self, tp):
            return self.group[tp]

    w = app_mod.Worker(WorkerSettings())
    w.consumer = c = Consumer(Consumer.group)

    async def scenario() -> None:
        await w.partitions.resets.take_baselines({unread, fresh, slow})
        assert sorted(asked) == [(0, 9), (2, 3)], "the record before the group's offset, where there is one"
        w.tracker.suspect_all()  # a connection broke before any record was read
        assert w.tracker.witness(unread) == (9, fingerprint(1000, b"k9", b"v9"))
        assert w.tracker.witness(fresh) is None and w.tracker.witness(slow) is None
        log[9] = rawfetch.RawRecord("jobs", 0, 9, 2000, b"b9", b"new", [])  # the new log's record 9
        w.tracker.add(unread, 10, fingerprint(2001, b"b10", b"new"))  # fetched on from the old position
        w.tracker.done(unread, 10)
        await w.partitions.commit()
        assert not c.commits, "nothing committed over the new log's first records"
        await w.partitions.resets.restart_due()
        assert c.rewound == [unread]

    asyncio.run(scenario())

def test_a_commit_asks_the_topics_id_and_a_new_one_restarts_every_partition(monkeypatch) -> None:
    """helper-78: a topic deleted, re-created and refilled between two fetches of a running
    worker shows nothing in offsets, high watermarks or leaders, and the next commit stepped
    over the new log's first jobs. Each commit now asks the topic's id after taking its offsets:
    the same id commits them; a new id restarts every assigned partition from its beginning
    (read or not) and commits nothing; a topic that is gone, or a broker that cannot be asked,
    commits nothing; a broker without ids is not asked again."""
    import asyncio

    from aiokafka.errors import KafkaConnectionError
    from aiokafka.structs import TopicPartition

    from qworker.worker import app as app_mod
    from qworker.worker import topic_ids

    read, unread = TopicPartition("jobs", 0), TopicPartition("jobs", 1)
    answers = [b"a" * 16, b"a" * 16, None, KafkaConnectionError("down"), b"b" * 16, b"b" * 16, topic_ids.TopicIdsUnsupported("old Kafka")]
    asked = []

    async def topic_id(consumer, topic):
        asked.append(topic)
        got = answers.pop(0)
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(topic_ids, "topic_id", topic_id)
    w = app_mod.Worker(WorkerSettings(jobs_topic="jobs"))
    w.consumer = c = _RecordingConsumer({read, unread})

    def read_one(off: int) -> None:
        w.tracker.add(read, off)
        w.tracker.done(read, off)

    async def rounds() -> None:
        await w.partitions.resets.same_topic()  # at assignment: the id the first records are read under
        for off, want in ((0, {read: 1}), (1, None), (2, None), (3, None)):
            read_one(off)
            await w.partitions.commit()
            assert c.commits[-1] == want if want else len(c.commits) == 1, off
        await w.partitions.resets.restart_due()  # the new id (b) restarted both
        assert c.metadata_updates == [1], "metadata asked again: the new topic may have more partitions"
        assert sorted(tp.partition for tp in c.rewound) == [0, 1] and read not in w.tracker.partitions()
        read_one(0)
        await w.partitions.commit()
        assert c.commits[-1] == {read: 1}, "the new topic's offsets, once read from its start"
        for off in (1, 2):  # a broker without ids: asked once, then commits go on unasked
            read_one(off)
            await w.partitions.commit()
        assert c.commits[-1] == {read: 3} and not answers and len(asked) == 7

    asyncio.run(rounds())

def test_a_new_topic_id_at_a_rebalance_spares_the_partitions_the_rebalance_restarted(monkeypatch) -> None:
    """helper-80: after a memory broker's restart the rebalance check restarted each partition
    (the group's offset was gone) and the first commit round's id check restarted them again
    (16 of 57 jobs answered twice). The id is now asked at the rebalance, and a new one restarts
    only the partitions the rebalance did not; a commit round that finds a log replaced asks the
    id at once, so a re-created topic restarts all its partitions in that one round."""
    import asyncio

    from aiokafka.structs import TopicPartition

    from qworker.worker import app as app_mod
    from qworker.worker import rawfetch, topic_ids
    from qworker.worker.offsets import fingerprint

    ids = iter([b"a" * 16, b"b" * 16, b"c" * 16, b"c" * 16])

    async def topic_id(consumer, topic):
        return next(ids)

    async def record_at(consumer, tp, offset):
        return rawfetch.RawRecord(tp.topic, tp.partition, offset, 9, b"new", b"new", [])

    monkeypatch.setattr(topic_ids, "topic_id", topic_id)
    monkeypatch.setattr(rawfetch, "record_at", record_at)
    reset, kept = TopicPartition("jobs", 0), TopicPartition("jobs", 1)
    w = app_mod.Worker(WorkerSettings())
    w.consumer = c = _RecordingConsumer({reset, kept})

    async def scenario() -> None:
        await w.partitions.resets.same_topic()  # a
        await w.partitions.resets.on_assigned(set(), {reset})  # b: the rebalance restarted `reset`
        await w.partitions.resets.restart_due()
        assert c.rewound == [kept]
        for tp in (reset, kept):
            w.tracker.add(tp, 0, fingerprint(1, b"k", b"v"))
            w.tracker.done(tp, 0)
        w.tracker.suspect(reset)  # its log found replaced in a commit round: the id (c) is asked then
        await w.partitions.commit()
        await w.partitions.resets.restart_due()
        assert sorted(tp.partition for tp in c.rewound) == [0, 1, 1] and not c.commits

    asyncio.run(scenario())

def test_a_broken_connection_or_a_moved_leader_makes_partitions_suspect() -> None:
    """The triggers of the check above: a connection that broke or timed out (not one closed
    for idling or at shutdown), and metadata showing a subscribed partition led by another
    broker or gone (not the first metadata, nor one that changes nothing)."""
    import asyncio

    from aiokafka import AIOKafkaConsumer
    from aiokafka.conn import CloseReason
    from aiokafka.protocol.metadata import MetadataResponse_v0

    from qworker.worker import consumer as kc

    def metadata(leaders: dict[int, int], topic: str = "jobs") -> MetadataResponse_v0:
        return MetadataResponse_v0(brokers=[(0, "127.0.0.1", 1), (1, "127.0.0.1", 2)],
                                   topics=[(0, topic, [(0, p, leader, [0, 1], [0, 1]) for p, leader in leaders.items()])])

    async def check() -> list[int]:
        consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1")
        try:
            return await triggers(consumer)
        finally:
            await consumer.stop()  # never started; an unclosed one complains when collected

    async def triggers(consumer: AIOKafkaConsumer) -> list[int]:
        consumer.subscribe(["jobs"])
        calls: list[int] = []
        kc.on_log_may_have_changed(consumer, lambda: calls.append(1))
        for reason in CloseReason:
            consumer._client._on_connection_closed(object(), reason)
        assert len(calls) == 2, "broken and timed out only"
        cluster = consumer._client.cluster
        for leaders, topic, suspect in (({0: 0, 1: 0}, "jobs", False), ({0: 0, 1: 0}, "jobs", False), ({0: 0, 1: 1}, "jobs", True),
                                        ({0: 0, 1: 1}, "other", True), ({0: 0, 1: 1}, "jobs", True), ({0: 0, 1: 1}, "jobs", False)):
            before = len(calls)
            cluster.update_metadata(metadata(leaders, topic))
            assert len(calls) - before == suspect, (leaders, topic)
        return calls

    asyncio.run(check())


def test_first_refused_takes_the_whole_batch_aiokafka_refuses() -> None:
    """aiokafka refuses a whole batch for one bad record, and the broker serves batches whole: the
    raw path must hand back every record of that batch from the position on (good ones to answer,
    bad ones to dead-letter) and resume after its last offset, not after the bad record."""
    from aiokafka import TopicPartition

    from qworker.worker.rawfetch import first_refused
    from tests.worker.kafka_batches import record_batch as _batch

    tp = TopicPartition("t", 0)
    good = _batch(0, [(b"a", b"1", []), (b"b", b"2", [("h", b"x")])])
    for codec in (0, 1, 4):  # none, gzip, zstd
        # a header key that is not UTF-8; in the uncompressed batch also a null one
        last = [("", b"NUL")] if codec == 0 else [(b"\x80", b"NUL")]
        bad = _batch(2, [(b"c", b"3", []), (b"d", b"4", [(b"\xff\xfe", b"v")]), (b"e", b"5", []), (b"f", b"6", last)],
                     codec, null_key_marker=b"NUL" if codec == 0 else None)
        after = _batch(6, [(b"g", b"7", [])])
        data = good + bad + after
        r = first_refused(tp, data, 1)
        assert r is not None and r.reason
        assert [(x.offset, x.key) for x in r.before] == [(1, b"b")] and r.before[0].raw_headers == [(b"h", b"x")]
        assert [(x.offset, x.key, x.decodable) for x in r.records] == [(2, b"c", True), (3, b"d", False), (4, b"e", True), (5, b"f", False)]
        assert r.records[3].raw_headers == [(last[0][0] or None, b"NUL")] and r.records[3].bad_header_keys == [last[0][0] or None]
        assert (r.first_offset, r.next_offset, r.raw) == (2, 6, bad)
        # a position inside the batch: the records already handled are not handed back
        r = first_refused(tp, bad + after, 4)
        assert [x.offset for x in r.before] == [] and [x.offset for x in r.records] == [4, 5] and (r.first_offset, r.next_offset) == (4, 6)
        assert first_refused(tp, good + after, 0) is None
    # a batch whose CRC does not hold: its records cannot be trusted, only its bytes are kept
    torn = bytearray(_batch(2, [(b"c", b"3", []), (b"d", b"4", [])]))
    torn[-1] ^= 0xFF
    r = first_refused(tp, good + bytes(torn) + _batch(4, [(b"g", b"7", [])]), 0)
    assert r is not None and "CRC" in r.reason and r.records is None
    assert [x.offset for x in r.before] == [0, 1] and (r.first_offset, r.next_offset, r.raw) == (2, 4, bytes(torn))


def test_the_worker_lifts_its_open_file_limit_to_the_hard_limit():
    """Container runtimes give a soft limit of 1,024 open files: a burst of connections took the
    Kafka client's sockets. The worker lifts the soft limit to what the hard limit allows."""
    import subprocess
    import sys

    code = (
        "import resource\n"
        "from qworker.worker.app import raise_open_file_limit\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 4096))\n"
        "print(raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(None, 1) == ["4096", "(4096, 4096)\n"], out.stdout


async def test_an_immediate_answer_refused_as_too_large_is_replaced_by_the_small_error() -> None:
    """An immediate answer (an error for a job that never runs) that the broker refused as too
    large was committed past with no answer: ``publish_side`` took every too-large refusal for a
    DLQ copy. Now it sends the small ``result_too_large`` error, as a run's answer does. The
    publisher is a stand-in: the broker the tests start cannot be given a record limit below the
    worker's own, which is when a real broker refuses an answer the worker sized to fit."""
    import asyncio
    from types import SimpleNamespace

    from aiokafka import TopicPartition

    from qworker.messages import dumps
    from qworker.worker.answers import Answers
    from qworker.worker.jobs import error_message
    from qworker.worker.publisher import DeliveryRefused

    class RefusesBigRecords:
        def __init__(self) -> None:
            self.sent: list[tuple[str, bytes]] = []

        async def deliver(self, topic, key, value, headers=None) -> None:
            if len(value) > 400:
                raise DeliveryRefused(f"{topic}: MessageSizeTooLargeError", too_large=True)
            self.sent.append((topic, value))

    tp = TopicPartition("jobs", 0)
    tracker: OffsetTracker[TopicPartition] = OffsetTracker()
    tracker.add(tp, 0)
    settings = SimpleNamespace(completions_topic="completions", dlq_topic="dlq", max_message_bytes=1 << 20)
    publisher = RefusesBigRecords()
    answers = Answers(SimpleNamespace(settings=settings, publisher=publisher, tracker=tracker))  # type: ignore[arg-type]
    msg = error_message("j1", "wrong_model", "this worker serves another model", retryable=False, metadata={"blob": "x" * 500})
    answers.publish_side("completions", "j1", dumps(msg), None, [(tp, 0)], answer=(msg, dumps))
    await asyncio.gather(*answers.side)
    [(topic, value)] = publisher.sent
    sent = orjson.loads(value)
    assert topic == "completions" and sent["job_id"] == "j1" and sent["error"]["code"] == "result_too_large"
    assert tracker.committable(tp) == 1  # answered, so committed past

    dlq_copy = b"y" * 500  # a DLQ copy the broker refuses: nothing to answer with, committed past as before
    tracker.add(tp, 1)
    answers.publish_side("dlq", None, dlq_copy, None, [(tp, 1)])
    await asyncio.gather(*answers.side)
    assert len(publisher.sent) == 1 and tracker.committable(tp) == 2


@pytest.mark.parametrize("case", ["tail_compacted", "empty_batch"])
def test_record_at_says_an_offset_compaction_removed_is_gone(case, monkeypatch) -> None:
    """helper-121: ``record_at`` decoded only the first batch reaching its offset by the header;
    a batch whose last records compaction removed (its lastOffsetDelta kept), or an empty one it
    kept, holds no record there, and the answer became "cannot say" (the jobs path then left
    the partition suspect, uncommitted) instead of "gone" (restart). The next batch tells."""
    import struct

    from aiokafka import TopicPartition
    from aiokafka.record.default_records import DefaultRecordBatchBuilder

    from qworker.worker import rawfetch

    def batch(base: int, deltas: list[int], last_delta: int) -> bytes:
        b = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0, producer_id=-1,
                                      producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
        for d in deltas:
            b.append(d, timestamp=1000 + d, key=b"k%d" % d, value=b"v%d" % d, headers=[])
        raw = bytearray(b.build())
        struct.pack_into(">q", raw, 0, base)
        struct.pack_into(">i", raw, 23, last_delta)  # lastOffsetDelta survives compaction
        return bytes(raw)

    data = {"tail_compacted": batch(10, [0, 1, 2], 4) + batch(15, [0, 1], 1),  # 13 and 14 removed
            "empty_batch": batch(10, [0, 1, 2], 2) + batch(13, [], 1) + batch(15, [0], 0)}[case]

    async def fetch_partition(consumer, tp, offset, max_bytes=0, max_wait_ms=0):
        return 0, 17, data

    monkeypatch.setattr(rawfetch, "_fetch_partition", fetch_partition)
    tp = TopicPartition("jobs", 0)
    assert asyncio.run(rawfetch.record_at(None, tp, 13)) == "offset 13 holds no record any more"
    assert asyncio.run(rawfetch.record_at(None, tp, 11)).key == b"k1"


def test_a_run_ending_while_the_ticker_sends_loses_no_delta() -> None:
    """helper-123: the run's end cancelled the stream's ticker even mid-flush, between taking its
    events (their seq numbers given) and enqueuing them (aiokafka's send waits while a
    partition's batch is full and the last one is unacknowledged): those deltas were never sent,
    a gap under the completion's last_seq. Now the ticker is stopped only between flushes."""
    from types import SimpleNamespace as NS

    from qworker.messages import Job, Sampling
    from qworker.worker.jobs import JobRunner, JobState

    class Engine:
        async def generate(self, rid, prompt, params, priority=0, deadline=None, **kw):
            def out(text, tid, fin):
                c = NS(index=0, text=text, token_ids=[tid], finish_reason=fin, logprobs=None)
                return NS(outputs=[c], finished=fin is not None, num_cached_tokens=0, metrics=None, error_code=None)
            yield out("A", 1, None)
            yield out("B", 2, None)
            await asyncio.sleep(0.2)  # the engine busy: the ticker (every 0.05 s) flushes "B"
            yield out("C", 3, "length")

        async def abort(self, rid):
            pass

    class Publisher:
        max_message_bytes = 1_000_000

        def __init__(self):
            self.calls, self.sent = 0, []

        async def send(self, topic, key, value, headers=None):
            self.calls += 1
            if self.calls == 2:  # the ticker's send waits on a full batch past the run's end
                await asyncio.sleep(0.4)
            self.sent.append(json.loads(value))
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut

    async def main():
        pub = Publisher()
        runner = JobRunner(Engine(), pub, "tokens", 0.05, "m")
        st = JobState(job=Job(id="j", prompt="x", stream=True, sampling=Sampling(max_tokens=3)), tp=None, offset=0, produced_at=0, received_at=0)
        st.new_run(0)
        c = await runner.run(st)
        return c, [d for d in pub.sent if d["run_id"] == c.run_id]

    c, deltas = asyncio.run(main())
    assert [d["seq"] for d in deltas] == list(range(c.last_seq + 1))
    assert "".join(d["text"] for d in deltas) == c.choices[0].text == "ABC"
