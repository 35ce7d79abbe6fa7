"""Log resets: noticing that a partition's log is no longer the one we read before a commit
steps over a new log's records.

A broker can come back without its data (memory storage restarted, a topic deleted and
re-created, an unclean leader election truncating a log): its new records reuse offsets we
already read. Taken for refetches, they would never be answered, and our next commit would step
over them. The rebalance check (``Partitions.check_kept``) compares the group's offsets; the
checks here run before every commit round, each for what the others cannot see:

- ``check_shrunk``: the log ends below what we read (for ``SHRUNK_CONFIRM_S``: a failover's new
  leader can trail for a moment).
- ``check_witnesses``: after anything that may have replaced a log (a broken connection, a moved
  or vanished leader: ``consumer.on_log_may_have_changed``; a fetch showing the log shorter:
  ``note_ends``), the log must still hold the record we read last (or, for a partition not read
  yet, the record before the group's offset: ``take_baselines``), else the partition restarts.
- ``same_topic``: the topic's id, asked between a commit's snapshot and the commit itself.

A reset partition is not committed; the poll loop restarts it between two fetches
(``restart_due``), its jobs in flight still answering but marking no offset of the new log.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from qworker.worker import rawfetch, topic_ids
from qworker.worker.offsets import OffsetTracker, record_fingerprint

if TYPE_CHECKING:
    from qworker.worker.partitions import Partitions

log = logging.getLogger("qworker.worker")
# how long one round of checks may wait, in all, on the broker
CHECK_TIMEOUT_S = 5.0
# how long a partition's log must stay shorter than what we read before we believe it was reset
SHRUNK_CONFIRM_S = 10.0
# how long a suspect partition may stay unchecked (and uncommitted) before each warning
SUSPECT_WARN_S = 30.0


class LogResets:
    def __init__(self, partitions: Partitions):
        self.p = partitions  # its consumer, tracker and start_afresh
        self._shrunk_since: dict[TopicPartition, float] = {}  # see check_shrunk
        # partitions to start afresh, why, and where to read again (None: the log's beginning);
        # the poll loop does it between two fetches (see restart_due)
        self._restarts_due: dict[TopicPartition, tuple[str, int | None]] = {}
        self._topic_id: bytes | None = None  # the jobs topic's id when last asked (see same_topic)
        self._topic_ids = True  # False once the broker showed it gives none
        # suspect partitions not checked yet: since when, last warned (see check_witnesses)
        self._unchecked_since: dict[TopicPartition, tuple[float, float]] = {}

    @property
    def consumer(self) -> AIOKafkaConsumer:
        return self.p.w.consumer

    @property
    def tracker(self) -> OffsetTracker[TopicPartition]:
        return self.p.tracker

    def withheld(self) -> set[TopicPartition]:
        """Partitions whose offsets belong to a log found reset or short: never committed."""
        return self._restarts_due.keys() | self._shrunk_since.keys()

    def forget(self, tp: TopicPartition) -> None:
        """``tp`` moved away, or a rebalance already placed it at the group's offset."""
        self._restarts_due.pop(tp, None)

    async def on_assigned(self, new: set[TopicPartition], restarted: set[TopicPartition]) -> None:
        """After a rebalance: baselines for the partitions ``new`` to us, and the topic's id (the
        one the first records are read under; a rebalance often follows a broker that lost its
        data). ``restarted``: those the rebalance check already placed at the group's offset of a
        new log: a new id must not restart them a second time (their jobs would run again)."""
        await self.take_baselines(new)
        await self.same_topic()
        for tp in restarted:
            self.forget(tp)

    async def committable(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        """Those of ``tps`` whose logs pass the checks before a commit round. A round that finds
        a log replaced asks the topic's id at once: a re-created topic then restarts all its
        partitions together, not this one now and the others (and this one again) a round later."""
        kept = await self.check_witnesses(await self.check_shrunk([tp for tp in tps if tp not in self._restarts_due]))
        if self._restarts_due:
            await self.same_topic()
        return [tp for tp in kept if tp not in self._restarts_due]

    async def take_baselines(self, tps: set[TopicPartition]) -> None:
        """For each partition newly ours, the record before the group's offset, where the
        consumer starts reading it: its witness if a connection breaks before we read a record of
        it (see ``check_witnesses``). A broker that comes back with a new log grown past that
        offset would otherwise have its first records skipped. Within one deadline; a partition
        not answered in time goes without (as before there was any)."""
        deadline = asyncio.get_running_loop().time() + CHECK_TIMEOUT_S

        async def take(tp: TopicPartition) -> None:
            async with asyncio.timeout_at(deadline):
                start = await self.consumer.committed(tp)
                if start:
                    before = await rawfetch.record_at(self.consumer, tp, start - 1)
                    if isinstance(before, rawfetch.RawRecord):
                        self.tracker.set_baseline(tp, start - 1, record_fingerprint(before))

        order = list(tps)
        for tp, got in zip(order, await asyncio.gather(*(take(tp) for tp in order), return_exceptions=True)):
            if isinstance(got, BaseException):
                log.debug("no baseline for %s: %r", tp, got)

    async def check_shrunk(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        """Those of ``tps`` that may be committed this round. A broker that lost its data between
        two of our commits (memory storage restarted, a topic re-created, an unclean leader
        election) shows first here: the fetch position sits past the new log's end, so its
        records are never fetched, and the group, a new one on that broker, has no offset to
        compare, or the one our next commit round would write over them. So before a commit the
        last fetch's high watermark is checked against what we read. Below it, the partition is
        not committed; once it has stayed below for SHRUNK_CONFIRM_S (a new leader's high
        watermark can trail the old one's for a moment after a failover, which must not replay a
        partition), the partition starts afresh from the group's offset where that lies inside
        the log (a truncated log), else from the log's beginning (a new one)."""
        now = asyncio.get_running_loop().time()
        self._shrunk_since = {tp: t for tp, t in self._shrunk_since.items() if tp in tps}
        kept = []
        for tp in tps:
            try:
                end = self.consumer.highwater(tp)
            except AssertionError:  # aiokafka's "not assigned": a rebalance began since we listed them
                continue
            seen = self.tracker.seen_up_to(tp)
            if end is None or seen is None or end >= seen:
                self._shrunk_since.pop(tp, None)
                kept.append(tp)
            elif now - self._shrunk_since.setdefault(tp, now) >= SHRUNK_CONFIRM_S:
                await self._restart_shrunk(tp, end, seen)
        return kept

    async def _restart_shrunk(self, tp: TopicPartition, end: int, seen: int) -> None:
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                theirs = await self.consumer.committed(tp)
        except (KafkaError, TimeoutError) as e:  # asked again next round
            log.debug("committed(%s) failed: %r", tp, e)
            return
        del self._shrunk_since[tp]
        self._restarts_due[tp] = (f"its log now ends at {end}, below the {seen} we read: the log was reset",
                                  theirs if theirs is not None and theirs <= end else None)

    async def same_topic(self) -> bool:
        """Whether the jobs topic is still the one read: its id (``topic_ids``) unchanged since
        last asked. Asked between a commit's snapshot of offsets and the commit itself: offsets of
        a topic deleted and re-created (whose new log outgrew our position between two fetches,
        which nothing else shows) would step over the new log's first records. A new id means a
        new log in every partition: each is read again from its beginning (records read since
        the last ask may already be the new log's, so there is nothing to compare with) and the
        round commits nothing; so does a topic that is gone, or a broker that cannot be asked
        (the commit would fail too). Brokers without topic ids (Kafka before 2.8) are not asked
        again."""
        if not self._topic_ids:
            return True
        topic = self.p.w.settings.jobs_topic
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                now = await topic_ids.topic_id(self.consumer, topic)
        except topic_ids.TopicIdsUnsupported as e:
            log.info("the broker gives no topic ids (%s): a topic re-created between two fetches goes unseen", e)
            self._topic_ids = False
            return True
        except (KafkaError, TimeoutError) as e:
            log.debug("topic id of %s not read: %r", topic, e)
            return False
        if now is None:
            return False  # deleted: when it is back, its new id restarts every partition
        if self._topic_id is None or now == self._topic_id:
            self._topic_id = now
            return True
        self._topic_id = now
        self.consumer._client.force_metadata_update()  # noqa: SLF001 - it may have other partitions now
        for tp in self.consumer.assignment():
            self._restarts_due[tp] = (f"the topic {topic} was re-created (its id changed)", None)
        return False

    def note_ends(self) -> None:
        """A partition whose last fetch shows its log ending below what we read becomes suspect
        (see ``check_witnesses``). Tansu answers fetches of a deleted topic with an empty log, no
        error, so neither metadata nor a broken connection tells of a topic deleted and
        re-created; and a new log refilled past our position within ``check_shrunk``'s 10 s
        would look continuous. Called after every poll: the fetch positions' high watermarks
        are fresh then."""
        for tp in self.tracker.partitions():
            try:
                end = self.consumer.highwater(tp)
            except AssertionError:  # aiokafka's "not assigned": a rebalance is under way
                continue
            seen = self.tracker.seen_up_to(tp)
            if end is not None and seen is not None and end < seen:
                self.tracker.suspect(tp)

    async def check_witnesses(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        """Those of ``tps`` that may be committed this round as far as their logs' identity goes.

        After a connection to the broker broke (or a leader moved), every partition is suspect
        (``OffsetTracker.suspect_all``): a broker that came back with a new log (memory storage
        restarted, a topic re-created; a pod frozen through it) numbers new records from 0 again,
        and once that log has grown past our position its offsets look continuous, so neither the shrink
        check nor the group's offsets (the new broker takes our commit) show it. Its first
        records would never be fetched, and our next commit would step over them. So the log is
        asked for the record at the witness's offset: the same record vouches for the log;
        another one, or none in a log that reaches past that offset (retention or compaction
        removed it: the same answer is the safe one), starts the partition afresh from the log's
        beginning (the group's offset may be the old log's). A log that does not reach the
        witness yet, or a broker that cannot be asked, leaves the partition suspect and
        uncommitted until a later round (a log that stays short is ``check_shrunk``'s)."""
        t0 = asyncio.get_running_loop().time()
        deadline = t0 + CHECK_TIMEOUT_S
        self._unchecked_since = {tp: t for tp, t in self._unchecked_since.items() if self.tracker.witness(tp) is not None}
        kept = []
        for tp in tps:
            witness = self.tracker.witness(tp)
            if witness is None:
                kept.append(tp)
                continue
            offset, known = witness
            try:
                async with asyncio.timeout_at(deadline):
                    now = await rawfetch.record_at(self.consumer, tp, offset)
            except (KafkaError, LookupError, TimeoutError) as e:
                self._still_unchecked(tp, t0, offset, f"the broker could not be asked: {e!r}")
                continue
            if now is None:
                self._still_unchecked(tp, t0, offset, "the log does not reach it")
                continue
            self._unchecked_since.pop(tp, None)
            if not isinstance(now, str) and record_fingerprint(now) == known:
                self.tracker.vouched(tp)
                kept.append(tp)
                continue
            why = now if isinstance(now, str) else f"offset {offset} holds another record than the one we read there"
            self._restarts_due[tp] = (f"{why} (checked as its log may have been replaced): the log was replaced", None)
        return kept

    def _still_unchecked(self, tp: TopicPartition, now: float, offset: int, why: str) -> None:
        """A suspect partition stays uncommitted; say so every SUSPECT_WARN_S (a stuck check
        would otherwise only show as reruns after the next restart)."""
        first, warned = self._unchecked_since.setdefault(tp, (now, now))
        if now - warned >= SUSPECT_WARN_S:
            self._unchecked_since[tp] = (first, now)
            log.warning("%s/%d: not committed for %.0f s: its log is unchecked since it may have been replaced (offset %d: %s)",
                        tp.topic, tp.partition, now - first, offset, why)

    async def restart_due(self) -> None:
        """Start afresh the partitions the commit loop found reset, and seek them. Called by the
        poll loop between two fetches: records of the old position still being decoded would
        otherwise land in the fresh tracker and mark the offsets below them seen (the rewound
        fetch would skip those jobs, the next commit step over them). Until then the partition
        is not committed (``commit`` leaves it out)."""
        for tp, (why, offset) in list(self._restarts_due.items()):
            if tp in self.consumer.assignment():  # else moved away: its new owner reads from the group's offset
                self.p.start_afresh(tp, why)
                if offset is not None:
                    self.consumer.seek(tp, offset)
                else:  # a failure raises before the entry goes: the next round does it again
                    await self.consumer.seek_to_beginning(tp)
            del self._restarts_due[tp]
