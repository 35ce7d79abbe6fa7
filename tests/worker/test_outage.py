"""Broker outage: Tansu on S3 storage (moto on loopback) goes away for 20 s mid-run and comes
back on the same port. The worker reconnects, loses no job, and never commits an offset whose
result was not delivered."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from qworker.broker import start_broker, stop_broker
from qworker.messages import Job, Sampling
from qworker.worker import Worker
from qworker.worker.client import create_topics, parse, submit
from qworker.worker.rawfetch import fetch_raw

from .conftest import Results, committed, make_settings, wait_committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

OUTAGE_S = float(20)


async def read_all(s, topic: str) -> list:
    """Every record of ``topic``: each partition is fetched until a fetch comes back empty (not
    until the reader has been idle for a second, which a slow broker can be with records left)."""
    c = AIOKafkaConsumer(bootstrap_servers=s.bootstrap_servers, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=20)
    await c.start()
    try:
        await c.topics()
        out = []
        for p in sorted(c.partitions_for_topic(topic) or ()):
            tp, pos = TopicPartition(topic, p), 0
            while recs := await fetch_raw(c, tp, pos, max_wait_ms=20):
                out += recs
                pos = recs[-1].offset + 1
        return out
    finally:
        await c.stop()


async def check_commits_delivered(s, timeout: float = 20.0) -> None:
    """Every job record below a committed offset has its answer on the completions topic.

    Right after the outage a fetch can come back empty with records still there (the S3-backed
    broker is slow to serve old segments again), so one short read of the completions topic is
    not proof of a lost answer: the check re-reads both topics until it holds or ``timeout``
    passes. Answers are never deleted, so a real loss still fails."""
    deadline = time.monotonic() + timeout
    while True:
        offs = await committed(s)
        answered = {parse(r.value)["job_id"] for r in await read_all(s, s.completions_topic)}
        unanswered = [
            (r.partition, r.offset)
            for r in await read_all(s, s.jobs_topic)
            if (c := offs.get(r.partition)) is not None and r.offset < c and parse(r.value)["id"] not in answered
        ]
        if not unanswered:
            return
        if time.monotonic() > deadline:
            p, o = unanswered[0]
            raise AssertionError(f"offset {p}/{o} committed without a delivered result ({len(unanswered)} such)")
        await asyncio.sleep(0.5)


async def test_broker_outage_20s(real_engine, tmp_path) -> None:
    eng, _ = real_engine
    broker = start_broker(s3=True, log_dir=tmp_path)
    try:
        s = make_settings(broker.bootstrap, session_timeout_ms=6000, request_timeout_ms=5000)
        await create_topics(s, partitions=4)
        r = await Results(s).start()
        w = Worker(s, eng)
        await w.start()
        try:
            ids = [f"o{i}" for i in range(30)]
            await submit(s, [Job(id=i, prompt=f"Say {i}", sampling=Sampling(max_tokens=8, temperature=0.0), stream=True) for i in ids])
            await r.wait(lambda: len(r.completions) >= 3, 60, "first completions")
            await asyncio.to_thread(broker.stop)
            t0 = time.monotonic()
            await asyncio.sleep(OUTAGE_S)
            await asyncio.to_thread(broker.start)
            await r.wait(lambda: set(r.completions) >= set(ids), 120, "every job after the outage")
            print(f"recovered {time.monotonic() - t0:.1f}s after the outage began; stats {w.stats}")
            assert all(v[0]["type"] == "completion" for v in r.completions.values())
            await check_commits_delivered(s)
            await wait_committed(s, timeout=30)
        finally:
            await w.stop(drain_timeout_s=10)
            await r.stop()
    finally:
        stop_broker(broker)
