"""Fixtures: one Tansu broker per session (loopback, stopped by pid), per-test topics, workers."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from qworker.broker import Broker, start_broker, stop_broker
from qworker.config import WorkerSettings
from qworker.worker.client import ResultReader, create_topics, parse

REPO = Path(__file__).resolve().parents[2]


def model_dir() -> Path | None:
    d = Path(os.environ.get("QWORKER_TEST_MODEL", REPO / "models" / "smollm2-135m"))
    return d if (d / "config.json").exists() else None


def engine_available() -> bool:
    try:
        from qworker.engine import AsyncEngine  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return model_dir() is not None


needs_engine = pytest.mark.skipif(not engine_available(), reason="qworker.engine.AsyncEngine or the model is not available")


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Broker:
    b = start_broker(log_dir=tmp_path_factory.mktemp("tansu"))
    yield b
    stop_broker(b)


def make_settings(bootstrap: str, **kw: Any) -> WorkerSettings:
    """Settings tuned for Tansu: short sessions (rebalances take ~half), short fetch waits,
    no idempotent producer (Tansu rejects aiokafka's InitProducerId)."""
    tag = uuid.uuid4().hex[:8]
    base = dict(
        bootstrap_servers=bootstrap,
        group_id=f"g-{tag}",
        jobs_topic=f"jobs-{tag}",
        tokens_topic=f"tokens-{tag}",
        completions_topic=f"completions-{tag}",
        dlq_topic=f"dlq-{tag}",
        cancel_topic=f"cancel-{tag}",
        enable_idempotence=False,
        session_timeout_ms=3000,
        heartbeat_interval_ms=500,
        fetch_max_wait_ms=20,
        commit_interval_ms=100,
        stream_interval_ms=20,
        linger_ms=1,
        request_timeout_ms=10000,
        http_port=-1,
        drain_timeout_s=30,
        log_level="INFO",
    )
    base.update(kw)
    return WorkerSettings(**base)


@pytest.fixture
async def topics(broker: Broker) -> WorkerSettings:
    s = make_settings(broker.bootstrap)
    await create_topics(s, partitions=4)
    return s


class Results:
    """Collects everything on the result topics, by job id."""

    def __init__(self, s: WorkerSettings):
        self.s = s
        self.reader = ResultReader(s)
        self.completions: dict[str, list[dict]] = {}
        self.deltas: dict[str, list[dict]] = {}
        self.dlq: list[Any] = []
        self._task: asyncio.Task | None = None

    async def start(self) -> Results:
        await self.reader.start()
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        async for rec in self.reader.records():
            if rec.topic == self.s.dlq_topic:
                self.dlq.append(rec)
                continue
            msg = parse(rec.value)
            # native messages name their job; OpenAI-shaped ones are found by the record key
            jid = msg.get("job_id") if isinstance(msg, dict) and "job_id" in msg else (rec.key or b"").decode("utf-8", "replace")
            if rec.topic == self.s.completions_topic:
                self.completions.setdefault(jid, []).append(msg)
            elif rec.topic == self.s.tokens_topic:
                self.deltas.setdefault(jid, []).append(msg)

    def finals(self) -> int:
        return len(self.completions) + len(self.dlq)

    async def wait(self, pred: Any, timeout: float, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what or pred}: {len(self.completions)} completions, {len(self.dlq)} dlq")
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.reader.stop()


@pytest.fixture
async def results(topics: WorkerSettings) -> Results:
    r = await Results(topics).start()
    yield r
    await r.stop()


def stream_text(deltas: list[dict], run_id: str, index: int = 0) -> str:
    evs = sorted((d for d in deltas if d["run_id"] == run_id and d["index"] == index), key=lambda d: d["seq"])
    seqs = [d["seq"] for d in sorted((d for d in deltas if d["run_id"] == run_id), key=lambda d: d["seq"])]
    assert seqs == list(range(len(seqs))), f"seq gaps or duplicates: {seqs}"
    return "".join(d["text"] for d in evs)


async def committed(s: WorkerSettings, partitions: int = 4) -> dict[int, int | None]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=s.bootstrap_servers, group_id=s.group_id, enable_auto_commit=False)
    await c.start()
    try:
        return {p: await c.committed(TopicPartition(s.jobs_topic, p)) for p in range(partitions)}
    finally:
        await c.stop()


async def partition_ends(s: WorkerSettings, partitions: int = 4) -> dict[int, int]:
    """One past the last record of each jobs partition, by reading them (Tansu's ListOffsets
    under-reports after batched produce). Raw fetches: a record aiokafka cannot decode (a
    header key that is not UTF-8) must not stop the count."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from qworker.worker.rawfetch import fetch_raw

    c = AIOKafkaConsumer(bootstrap_servers=s.bootstrap_servers, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=20)
    await c.start()
    try:
        await c.topics()
        ends = {p: 0 for p in range(partitions)}
        for p in range(partitions):
            while recs := await fetch_raw(c, TopicPartition(s.jobs_topic, p), ends[p], max_wait_ms=20):
                ends[p] = recs[-1].offset + 1
        return ends
    finally:
        await c.stop()


async def wait_committed(s: WorkerSettings, timeout: float = 10.0, partitions: int = 4) -> dict[int, int | None]:
    """Wait until the group has committed past every record of the jobs topic. The ends are read
    again each round: right after a broker outage a fetch can come back empty with records still
    there, and one short read would fail the wait however long it lasts."""
    deadline = time.monotonic() + timeout
    while True:
        ends = await partition_ends(s, partitions)
        c = await committed(s, partitions)
        if all((c[p] or 0) == ends[p] for p in ends):
            return c
        if time.monotonic() > deadline:
            raise AssertionError(f"committed {c}, records end at {ends}")
        await asyncio.sleep(0.2)


# ---------------------------------------------------------------------------- the real model
# One model load for every in-process test: offline references are computed with LLM first,
# then the same LLMEngine is wrapped in an AsyncEngine for the workers. A small KV pool
# (12 MiB, about 270 tokens) makes backpressure and over-long prompts cheap to provoke.
KV_BYTES = 12 * 2**20

GREEDY_INPUTS: dict[str, object] = {
    "plain": "The capital of France is",
    "chat": [{"role": "user", "content": "Name a colour."}],
    "ids": [504, 3458, 282, 4649, 314],
}
GREEDY_MAX_TOKENS = 8


@pytest.fixture(scope="session")
def real_engine() -> tuple[object, dict[str, object]]:
    if not engine_available():
        pytest.skip("qworker.engine or the model is not available")
    from qworker.engine import LLM, AsyncEngine, SamplingParams

    llm = LLM(str(model_dir()), kv_cache_memory=KV_BYTES)
    params = SamplingParams(max_tokens=GREEDY_MAX_TOKENS, temperature=0.0)
    outs = llm.generate(list(GREEDY_INPUTS.values()), params)
    refs = {k: o.outputs[0] for k, o in zip(GREEDY_INPUTS, outs)}
    eng = AsyncEngine(llm.engine)
    asyncio.run(eng.start())
    yield eng, refs
    asyncio.run(eng.shutdown())
