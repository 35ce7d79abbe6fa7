"""Client-side helpers shared by the CLI, the demo, ``openai_batch`` and the tests: create
topics, submit jobs, follow results. Below ``worker/`` and ``openai_batch/``: it imports neither."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from qworker.config import WorkerSettings
from qworker.messages import Cancel, Job, dumps, loads
from qworker.job_ids import is_openai_line
from qworker.producer import start_producer


log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # a result reader's close, at most


def result_topics(s: WorkerSettings) -> list[str]:
    return [s.tokens_topic, s.completions_topic, s.dlq_topic]


async def create_topics(s: WorkerSettings, partitions: int = 8, replication: int = 1, cancel_partitions: int = 1) -> list[str]:
    """Create the five topics (existing ones are left alone). Size the jobs topic for the most
    pods you will run: partitions bound parallelism and cannot be added on Tansu."""
    admin = AIOKafkaAdminClient(**s.kafka_common())
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        want = [(s.jobs_topic, partitions), (s.tokens_topic, partitions), (s.completions_topic, partitions), (s.dlq_topic, 1), (s.cancel_topic, cancel_partitions)]
        new = [NewTopic(name, n, replication) for name, n in want if name not in existing]
        if new:
            await admin.create_topics(new)
        return [t.name for t in new]
    finally:
        await admin.close()


# jobs may be larger than results (a prompt may reach 4 M characters): the broker's and the
# jobs topic's limits decide, not the worker's max_message_bytes
MAX_JOB_RECORD_BYTES = 8 * 2**20


async def producer_for(s: WorkerSettings) -> AIOKafkaProducer:
    return await start_producer({**s.producer_options(), "linger_ms": 2, "max_request_size": MAX_JOB_RECORD_BYTES})


async def submit(s: WorkerSettings, jobs: Iterable[Job | dict | bytes], producer: AIOKafkaProducer | None = None) -> list[str]:
    """Produce jobs (models, dicts or raw bytes, keyed by id when there is one); returns ids."""
    own = producer is None
    p = producer or await producer_for(s)
    ids, futs = [], []
    try:
        for j in jobs:
            if isinstance(j, Job):
                key, value = j.id, dumps(j)
            elif isinstance(j, dict):
                # an OpenAI batch request line is keyed by its custom_id, a native job by its id
                key, value = str(j.get("custom_id" if is_openai_line(j) else "id", "")), dumps_any(j)
            else:
                key, value = None, j
            ids.append(key)
            futs.append(await p.send(s.jobs_topic, value=value, key=key.encode("utf-8", "surrogatepass") if key else None))
        await asyncio.gather(*futs)
    finally:
        if own:
            await p.stop()
    return ids


def dumps_any(obj: Any) -> bytes:
    import json

    import orjson

    try:
        return orjson.dumps(obj)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(obj).encode("utf-8", "surrogatepass")


async def cancel(s: WorkerSettings, job_id: str, reason: str | None = None) -> None:
    p = await producer_for(s)
    try:
        await p.send_and_wait(s.cancel_topic, value=dumps(Cancel(job_id=job_id, reason=reason)), key=job_id.encode())
    finally:
        await p.stop()


class TopicsMissing(TimeoutError):
    """The topics a result reader was asked for did not appear in time."""


class ResultReader:
    """Reads result topics without a group (every partition, from the start or near the end).

    Tansu's ListOffsets(LATEST) under-reports after batched produce, so "from the end" may show
    a few older records: callers filter by job id."""

    def __init__(self, s: WorkerSettings, topics: list[str] | None = None, from_beginning: bool = True, fetch_max_wait_ms: int = 20):
        self.s, self.topics, self.from_beginning = s, topics or result_topics(s), from_beginning
        self.consumer = AIOKafkaConsumer(**s.kafka_common(), group_id=None, enable_auto_commit=False, fetch_max_wait_ms=fetch_max_wait_ms, auto_offset_reset="earliest" if from_beginning else "latest")

    async def start(self, timeout: float = 20.0) -> None:
        try:
            await self.consumer.start()
        except BaseException:  # e.g. no broker: the consumer is not left open behind the error
            await self.stop()
            raise
        deadline = time.monotonic() + timeout
        while True:
            await self.consumer.topics()
            tps = [TopicPartition(t, p) for t in self.topics for p in sorted(self.consumer.partitions_for_topic(t) or ())]
            if tps and all(self.consumer.partitions_for_topic(t) for t in self.topics):
                break
            if time.monotonic() > deadline:
                await self.consumer.stop()  # not left open behind the error (a no-op if the caller stops it too)
                raise TopicsMissing(f"topics {self.topics} not found on the broker after {timeout:g} s (create them: qworker topics create)")
            await asyncio.sleep(0.2)
        self.consumer.assign(tps)
        if self.from_beginning:
            await self.consumer.seek_to_beginning(*tps)
        else:
            await self.consumer.seek_to_end(*tps)

    async def records(self, idle_timeout: float | None = None) -> AsyncIterator[Any]:
        """Yields raw records; stops after ``idle_timeout`` seconds without any."""
        last = time.monotonic()
        while True:
            batches = await self.consumer.getmany(timeout_ms=100, max_records=1000)
            for recs in batches.values():
                for r in recs:
                    last = time.monotonic()
                    yield r
            if idle_timeout is not None and time.monotonic() - last > idle_timeout:
                return

    async def caught_up(self, ends: dict) -> bool:
        """The reader is at or past ``ends`` (end offsets taken earlier) on every partition in it:
        a busy topic is never quiet, so "read up to where it ended then" stands in for "idle"."""
        for tp, end in ends.items():
            if await self.consumer.position(tp) < end:
                return False
        return True

    async def stop(self) -> None:
        """Closes the consumer, within ``STOP_TIMEOUT_S``. With the broker gone aiokafka's close
        can hang or raise (even CancelledError, from its own fetch task): whatever the caller
        read must not be lost for that, so only a cancellation of the caller itself propagates."""
        try:
            await asyncio.wait_for(self.consumer.stop(), STOP_TIMEOUT_S)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            log.debug("result reader: closing the consumer was cancelled inside aiokafka")
        except Exception as e:  # noqa: BLE001 - see above
            log.debug("result reader: closing the consumer failed: %r", e)


def parse(value: bytes | None) -> Any:
    try:
        return loads(value) if value else None
    except (ValueError, RecursionError):
        return None
