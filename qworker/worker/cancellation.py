"""Cancellation: every pod reads the whole cancel topic and aborts the jobs it holds.

The cancel consumer has no group (manual assignment of all partitions), so each pod sees each
cancel. It starts ``ttl`` seconds back in time (``offsets_for_times``), and cancels are
remembered for ``ttl``: a cancel that arrives before its job, or a job rerun after a crash, is
still honoured.

The topic can change under the reader: deleted and re-created (its records numbered from 0
again, perhaps with another partition count), given more partitions, or served anew by a broker
that lost its data. Nothing in a fetch says so (Tansu serves a deleted topic as an empty log), so
every ``LOG_CHECK_S`` the reader compares what it reads with what the topic is now and, on any
difference, assigns itself again from ``ttl`` back. Reading a cancel twice is harmless: the
registry keeps one entry per job id, and a job is cancelled once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import CorruptRecordException, KafkaError

from qworker.messages import MAX_ID_LEN, Cancel, loads
from qworker.worker import rawfetch, topic_ids
from qworker.worker.consumer import getmany
from qworker.worker.offsets import record_fingerprint

log = logging.getLogger(__name__)
# how often the reader checks that the cancel topic is still the log it reads (see the module doc)
LOG_CHECK_S = 5.0


class CancelRegistry:
    """Recently cancelled job ids, bounded in size and age.

    Age counts from when the cancel was *produced* (the record's timestamp, wall-clock
    seconds), not from when this pod read it: a pod that starts later and rereads the topic
    must honour exactly the cancels an older pod would still honour, no older ones."""

    def __init__(self, ttl_s: float, max_size: int = 100_000):
        self.ttl_s, self.max_size = ttl_s, max_size
        self._ids: OrderedDict[str, float] = OrderedDict()

    def add(self, job_id: str, at: float | None = None) -> bool:
        """Remember a cancel made at Unix time ``at`` (default now); False if already expired."""
        now = time.time()
        # a timestamp from the future (a producer's skewed clock) counts as now: else the cancel
        # would outlive its TTL by the skew, on this pod only
        at = now if at is None else min(at, now)
        if now - at > self.ttl_s:
            return False
        if at >= self._ids.get(job_id, float("-inf")):
            self._ids[job_id] = at
            self._ids.move_to_end(job_id)
        while len(self._ids) > self.max_size:
            self._ids.popitem(last=False)
        return True

    def __contains__(self, job_id: str) -> bool:
        t = self._ids.get(job_id)
        if t is None:
            return False
        if time.time() - t > self.ttl_s:
            del self._ids[job_id]
            return False
        return True


def record_time(rec: object) -> float:
    """A record's timestamp in Unix seconds (now when the broker gave none)."""
    ts = getattr(rec, "timestamp", None)
    return ts / 1000 if isinstance(ts, int) and ts > 0 else time.time()


def parse_cancel(key: bytes | None, value: bytes | None) -> str | None:
    """A cancel is ``{"job_id": ...}``; a bare key with an empty or unparseable value also counts."""
    if value:
        try:
            return Cancel.model_validate(loads(value)).job_id
        except Exception:  # noqa: BLE001 - fall back to the key; a bad cancel must not stop the reader
            pass
    if key and len(key) <= 4 * MAX_ID_LEN:  # no job id is longer: a longer key cancels nothing
        try:
            job_id = key.decode("utf-8")
        except UnicodeDecodeError:
            return None
        # only what could be a job id is remembered: the registry holds up to 100,000 of them
        return job_id if 1 <= len(job_id) <= MAX_ID_LEN else None
    return None


class CancelWatcher:
    """Reads the cancel topic and calls ``on_cancel(job_id, made_at)`` for each cancel younger
    than the TTL. ``alive()`` is False once the reader died (it feeds /healthz): a silent
    reader would let cancelled jobs run on unnoticed."""

    def __init__(self, topic: str, consumer_options: dict[str, Any], on_cancel: Callable[[str, float], Awaitable[None]], ttl_s: float):
        opts = {k: v for k, v in consumer_options.items() if k not in ("group_id", "session_timeout_ms", "heartbeat_interval_ms", "max_poll_interval_ms", "rebalance_timeout_ms")}
        self.consumer = AIOKafkaConsumer(group_id=None, enable_auto_commit=False, **{k: v for k, v in opts.items() if k != "enable_auto_commit"})
        self.topic, self.on_cancel, self.ttl_s = topic, on_cancel, ttl_s
        self._task: asyncio.Task | None = None
        self.seen = 0
        self.reassigned = 0  # times the topic was found changed and read again
        # per partition, (offset, fingerprint) of a record the log held at the last check (or
        # the one before the position at assignment): the log must still hold it (a re-created
        # topic that grew past our position does not). The last record read since that check
        # waits in _latest and becomes the witness only once a check has passed: read from a log
        # that replaced ours, it would vouch for the new log.
        self._witness: dict[TopicPartition, tuple[int, int]] = {}
        self._latest: dict[TopicPartition, tuple[int, int]] = {}
        self._topic_id: bytes | None = None  # the topic's id when assigned (None: not known)
        self._stale = False  # the topic changed and the assignment to its new log is not done yet

    async def start(self) -> None:
        await self.consumer.start()
        self._task = asyncio.create_task(self._run(), name="cancel-watcher")

    @property
    def task(self) -> asyncio.Task:
        """The reader's task (started by ``start``): the worker logs its end as any loop's."""
        assert self._task is not None, "not started"
        return self._task

    async def _partitions(self) -> set[int]:
        """The topic's partitions as the broker has them now (empty: no such topic). Asked afresh:
        ``consumer.topics()`` does not update the metadata ``partitions_for_topic`` answers from,
        which would keep a re-created topic's old partition count."""
        cluster = await self.consumer._client.fetch_all_metadata()  # noqa: SLF001 - aiokafka has no public call
        return cluster.partitions_for_topic(self.topic) or set()

    async def _assign(self) -> bool:
        parts = await self._partitions()
        tps = [TopicPartition(self.topic, p) for p in sorted(parts)]
        if not tps:
            return False
        self._topic_id = await self._current_topic_id()
        self.consumer.assign(tps)
        self._witness.clear()
        self._latest.clear()
        since = max(0, int((time.time() - self.ttl_s) * 1000))
        found = await self.consumer.offsets_for_times({tp: since for tp in tps})
        for tp in tps:
            ot = found.get(tp)
            if ot is not None:
                self.consumer.seek(tp, ot.offset)
            else:
                await self.consumer.seek_to_end(tp)
        for tp in tps:
            await self._witness_before_position(tp)
        return True

    async def _witness_before_position(self, tp: TopicPartition) -> None:
        """The record just before where ``tp`` is read from, as its first witness (a log that
        is replaced before anything is read of it is noticed too); none where there is no such
        record or the broker does not say."""
        position = await self.consumer.position(tp)
        if position <= 0:
            return
        try:
            got = await rawfetch.record_at(self.consumer, tp, position - 1)
        except (KafkaError, LookupError):
            return
        if isinstance(got, rawfetch.RawRecord):
            self._witness[tp] = (position - 1, record_fingerprint(got))

    async def _current_topic_id(self) -> bytes | None:
        """The topic's id now; None where the broker gives none or cannot be asked."""
        try:
            return await topic_ids.topic_id(self.consumer, self.topic)
        except (topic_ids.TopicIdsUnsupported, KafkaError):
            return None

    async def _changed(self) -> str | None:
        """Why the topic is no longer the log being read (see the module doc), or None."""
        parts = await self._partitions()
        assigned = self.consumer.assignment()
        if parts != {tp.partition for tp in assigned}:
            return f"its partitions are now {sorted(parts)}"
        if self._topic_id is not None:
            now = await self._current_topic_id()
            if now is not None and now != self._topic_id:
                return "it was re-created (a new topic id)"
        for tp, (offset, fp) in list(self._witness.items()):
            got = await rawfetch.record_at(self.consumer, tp, offset)
            if got is None or isinstance(got, str) or record_fingerprint(got) != fp:
                return f"partition {tp.partition} no longer holds offset {offset} as read"
        return None

    async def _check_log(self) -> None:
        """Assign again (from ``ttl`` back) when the topic changed. An assignment not finished
        (the topic deleted and not back yet, the broker not answering) is tried again next round:
        until then the reader's positions cannot be trusted, so it is not checked, only redone."""
        try:
            if not self._stale:
                async with asyncio.timeout(LOG_CHECK_S):
                    why = await self._changed()
                if why is None:
                    self._witness.update(self._latest)  # checked next round against the log as it is then
                    self._latest.clear()
                    return
                log.warning("cancel topic %s changed (%s): reading it again from %.0f s back", self.topic, why, self.ttl_s)
                self.reassigned += 1
                self._stale = True
            self._stale = not await self._assign()
        except (KafkaError, LookupError, TimeoutError) as e:
            log.debug("cancel reader: log check not answered: %r", e)
        except Exception:  # noqa: BLE001 - a dead reader would drop every later cancel
            log.exception("cancel reader: log check failed")

    def alive(self) -> bool:
        return self._task is None or not self._task.done()

    async def _run(self) -> None:
        while True:
            try:
                if await self._assign():
                    break
            except KafkaError as e:
                log.warning("cancel topic %s not readable yet: %r", self.topic, e)
            await asyncio.sleep(1.0)
        loop = asyncio.get_running_loop()
        next_check = loop.time() + LOG_CHECK_S
        while True:
            if loop.time() >= next_check:
                await self._check_log()
                next_check = loop.time() + LOG_CHECK_S
            try:
                batches = await getmany(self.consumer, timeout_ms=200, max_records=1000)
            except CorruptRecordException as e:  # a CRC or a record aiokafka's parser refuses
                log.warning("cancel reader: corrupt record batch (%r); reading it raw", e)
                await self._skip_refused_or_wait()
                continue
            except KafkaError as e:
                log.warning("cancel reader: %r", e)
                await asyncio.sleep(0.5)
                continue
            except Exception as e:  # noqa: BLE001 - e.g. a header key aiokafka cannot decode
                log.warning("cancel reader: undecodable record (%r); reading its batch raw", e)
                await self._skip_refused_or_wait()
                continue
            for tp, records in batches.items():
                for rec in records:
                    await self._handle(rec)
                if records:
                    self._latest[tp] = (records[-1].offset, record_fingerprint(records[-1]))

    async def _skip_refused_or_wait(self) -> None:
        try:
            await self._skip_refused()
        except Exception:  # noqa: BLE001 - a dead reader would silently drop every later cancel
            log.exception("cancel reader: skipping failed")
            await asyncio.sleep(0.5)

    async def _handle(self, rec: Any) -> None:
        job_id = parse_cancel(rec.key, rec.value)
        if job_id:
            self.seen += 1
            try:
                await self.on_cancel(job_id, record_time(rec))
            except Exception:  # noqa: BLE001
                log.exception("cancel failed", extra={"job_id": job_id})

    async def _skip_refused(self) -> None:
        """A batch aiokafka refuses (see ``Intake.skip_refused``): handle the records before it and
        its own (a cancel's headers do not matter), or none of it when its bytes cannot be
        trusted, and seek past it; without this the reader would stop at that batch for good."""
        from qworker.worker.rawfetch import refused_batches

        try:
            found = await refused_batches(self.consumer, sorted(self.consumer.assignment()))
        except KafkaError as e:
            log.warning("cancel reader: raw fetch failed: %r", e)
            await asyncio.sleep(0.5)
            return
        if not found:
            await asyncio.sleep(0.5)
        for tp, batch in found.items():
            trusted = batch.before + (batch.records or [])
            for rec in trusted:
                await self._handle(rec)
            if trusted:
                self._latest[tp] = (trusted[-1].offset, record_fingerprint(trusted[-1]))
            if batch.records is None:
                log.warning("cancel reader: skipped %s/%d offsets %d-%d (%s)", tp.topic, tp.partition, batch.first_offset,
                            batch.next_offset - 1, batch.reason)
            self.consumer.seek(tp, batch.next_offset)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()
