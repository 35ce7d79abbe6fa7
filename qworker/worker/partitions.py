"""Partitions: what this member owns of the jobs topic, and the offsets it may commit.

Owns the ``OffsetTracker`` (per partition: offsets seen, finished, committed), the group
``generation``, whether the consumer has ``joined`` and the partitions revoked since the last
assignment. Invariants:

- A partition's committed offset only moves past records whose answers the broker acknowledged.
- On a rebalance, jobs keep running until the assignment says which partitions actually moved;
  the lost ones' unfinished jobs are abandoned without committing (their next owner reruns them).
- A kept partition whose group offset went below ours (log reset) starts afresh: its in-flight
  jobs still answer, but mark no offsets of the new log. So does one whose log, after a broken
  connection, no longer holds the record we read last (see ``check_witnesses``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from qworker.worker import consumer as kc
from qworker.worker import rawfetch, topic_ids
from qworker.worker.jobs import JobState
from qworker.worker.offsets import OffsetTracker, fingerprint

if TYPE_CHECKING:
    from qworker.worker.app import Worker

log = logging.getLogger("qworker.worker")
# how long a rebalance may wait, in all, for the group's offsets of the partitions it keeps
KEPT_CHECK_TIMEOUT_S = 5.0
# how long a partition's log must stay shorter than what we read before we believe it was reset
SHRUNK_CONFIRM_S = 10.0
# how long a suspect partition may stay unchecked (and uncommitted) before each warning
SUSPECT_WARN_S = 30.0

# The partition of a job whose log was reset under it: it still answers, marks no offset.
DETACHED = TopicPartition("", -1)


class Partitions:
    def __init__(self, worker: Worker):
        self.w = worker  # consumer, stats, registry, intake (to requeue an heir), telemetry
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self.generation = 0
        # grows when a rebalance begins and when it ends: records fetched under another epoch may
        # belong to an ownership that ended (even one regained since: the consumer then rewound
        # to the committed offsets and fetches them again), so intake drops them
        self.epoch = 0
        self.joined = False  # the consumer joined its group (it may own no partition)
        self.revoked: set[TopicPartition] = set()
        self._shrunk_since: dict[TopicPartition, float] = {}  # see check_shrunk
        # partitions to start afresh, why, and where to read again (None: the log's beginning);
        # the poll loop does it between two fetches (see restart_due)
        self._restarts_due: dict[TopicPartition, tuple[str, int | None]] = {}
        self._topic_id: bytes | None = None  # the jobs topic's id when last asked (see same_topic)
        self._topic_ids = True  # False once the broker showed it gives none
        # suspect partitions not checked yet: since when, last warned (see check_witnesses)
        self._unchecked_since: dict[TopicPartition, tuple[float, float]] = {}

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit what is done before ownership may move. Jobs keep running until we learn, in
        ``on_assigned``, which partitions actually moved (an eager rebalance revokes all)."""
        w = self.w
        w.stats.rebalances += 1
        self.epoch += 1
        self.revoked |= revoked
        # not those whose log was found reset or short: the offset we hold belongs to the old log
        c, f = await kc.commit(w.consumer, self.tracker, list(revoked - self._restarts_due.keys() - self._shrunk_since.keys()), self.same_topic)
        w.stats.commits += c
        w.stats.commit_failures += f

    async def on_assigned(self, assigned: set[TopicPartition]) -> None:
        w = self.w
        self.generation = kc.generation(w.consumer)
        self.epoch += 1
        self.joined = True
        lost = (self.revoked | set(self.tracker.partitions())) - assigned
        self.revoked = set()
        if lost:
            self.abandon(lost)
        await self.check_kept(assigned)
        await self.take_baselines(assigned - set(self.tracker.partitions()))
        if self._topic_id is None:
            await self.same_topic()  # the id the first records will be read under
        if w.pauser is not None and w.pauser.paused:
            w.consumer.pause(*assigned)  # a rebalance clears pauses
        log.info("assigned %s (generation %d)", sorted(f"{tp.topic}/{tp.partition}" for tp in assigned), self.generation)

    async def check_kept(self, assigned: set[TopicPartition]) -> None:
        """A kept partition whose group offset is now below the one we committed (or gone) no
        longer holds the records we saw: the broker lost its data (a topic re-created, a log
        truncated by an unclean election, memory storage restarted) or an operator reset the
        group's offsets. Its new records reuse offsets we already saw; keeping our "seen up to"
        mark would take them for refetches and never answer them. So the partition starts
        afresh; its in-flight jobs still answer, but no longer mark offsets of the new log.

        A partition we read but never committed is checked too: a group with no offset at all
        for it may be a new group that has committed nothing yet, or a broker that lost its data
        before our first commit (whose new records the stale mark would skip, and whose next
        commit would then step over them: lost). The two cannot be told apart, so it starts
        afresh either way: the consumer rewinds, jobs still held are recognised by id, and only
        jobs finished since the last commit round run again (at-least-once, never a loss)."""
        # One deadline for all of them: a stalled broker must not hold up the rebalance (5 s per
        # partition, one after the other, was 40 s for 8 partitions). Unchecked ones stay as they are.
        deadline = asyncio.get_running_loop().time() + KEPT_CHECK_TIMEOUT_S
        for tp in sorted(assigned & set(self.tracker.partitions()), key=lambda t: t.partition):
            ours = self.tracker.last_committed(tp)
            try:
                async with asyncio.timeout_at(deadline):
                    theirs = await self.w.consumer.committed(tp)
            except (KafkaError, TimeoutError) as e:
                log.debug("committed(%s) failed: %r", tp, e)
                continue
            if theirs is not None and (ours is None or theirs >= ours):
                continue
            if ours is None:
                self.start_afresh(tp, "the group has no offset for a partition we read but never committed: its log may have been reset")
            else:
                self.start_afresh(tp, f"the group's offset is {theirs}, below the {ours} we committed: the log was reset")
            self._restarts_due.pop(tp, None)  # the rebalance already placed it at the group's offset

    async def take_baselines(self, tps: set[TopicPartition]) -> None:
        """For each partition newly ours, the record before the group's offset, where the
        consumer starts reading it: its witness if a connection breaks before we read a record of
        it (see ``check_witnesses``). A broker that comes back with a new log grown past that
        offset would otherwise have its first records skipped. Within one deadline; a partition
        not answered in time goes without (as before there was any)."""
        deadline = asyncio.get_running_loop().time() + KEPT_CHECK_TIMEOUT_S

        async def take(tp: TopicPartition) -> None:
            async with asyncio.timeout_at(deadline):
                start = await self.w.consumer.committed(tp)
                if start:
                    before = await rawfetch.record_at(self.w.consumer, tp, start - 1)
                    if isinstance(before, rawfetch.RawRecord):
                        self.tracker.set_baseline(tp, start - 1, fingerprint(before.timestamp, before.key, before.value))

        order = list(tps)
        for tp, got in zip(order, await asyncio.gather(*(take(tp) for tp in order), return_exceptions=True)):
            if isinstance(got, BaseException):
                log.debug("no baseline for %s: %r", tp, got)

    def start_afresh(self, tp: TopicPartition, why: str) -> None:
        """Forget what we saw of ``tp``'s log: its jobs in flight still answer but mark no offset."""
        log.warning("%s/%d: %s; starting the partition afresh", tp.topic, tp.partition, why)
        for st in self.w.registry.jobs.values():
            st.waiters = [wt for wt in st.waiters if wt[0] != tp]
            if st.tp == tp:
                st.tp = DETACHED
        self.tracker.drop(tp)

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
                end = self.w.consumer.highwater(tp)
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
            async with asyncio.timeout(KEPT_CHECK_TIMEOUT_S):
                theirs = await self.w.consumer.committed(tp)
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
        topic = self.w.settings.jobs_topic
        try:
            async with asyncio.timeout(KEPT_CHECK_TIMEOUT_S):
                now = await topic_ids.topic_id(self.w.consumer, topic)
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
        for tp in self.w.consumer.assignment():
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
                end = self.w.consumer.highwater(tp)
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
        deadline = t0 + KEPT_CHECK_TIMEOUT_S
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
                    now = await rawfetch.record_at(self.w.consumer, tp, offset)
            except (KafkaError, LookupError, TimeoutError) as e:
                self._still_unchecked(tp, t0, offset, f"the broker could not be asked: {e!r}")
                continue
            if now is None:
                self._still_unchecked(tp, t0, offset, "the log does not reach it")
                continue
            self._unchecked_since.pop(tp, None)
            if not isinstance(now, str) and fingerprint(now.timestamp, now.key, now.value) == known:
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
            if tp in self.w.consumer.assignment():  # else moved away: its new owner reads from the group's offset
                self.start_afresh(tp, why)
                if offset is not None:
                    self.w.consumer.seek(tp, offset)
                else:  # a failure raises before the entry goes: the next round does it again
                    await self.w.consumer.seek_to_beginning(tp)
            del self._restarts_due[tp]

    def abandon(self, lost: set[TopicPartition]) -> None:
        """Abort the lost partitions' unfinished jobs without committing them: the new owner
        reruns them. A queued job whose waiters sit on partitions we keep is requeued for them.
        A *running* job with such waiters keeps running and answers them: aborting it could
        race its delivery (the completion already acknowledged) and run it a second time here."""
        w, reg = self.w, self.w.registry
        for st in list(reg.jobs.values()):
            st.waiters = [wt for wt in st.waiters if wt[0] not in lost]
            if st.tp not in lost:
                continue
            if st.admitted and st.waiters:
                continue  # its record on the lost partition is the new owner's; done() ignores it
            if st.admitted:
                st.task.cancel()  # its run records the outcome
            else:
                reg.pending.remove(st)
                st.tele.outcome("abandoned")
            reg.forget(st)
            if st.waiters:
                (tp, off), rest = st.waiters[0], st.waiters[1:]
                # everything intake settled for the job carries over: its prompt, parameters, wire
                # shape, adapter (without it the heir would answer from the base model) and grammar check
                heir = JobState(job=st.job, tp=tp, offset=off, produced_at=st.produced_at, received_at=st.received_at, waiters=rest, prompt_ids=st.prompt_ids, params=st.params,
                                wire=st.wire, lora=st.lora, structured_validated=st.structured_validated, waiter_records=st.waiter_records)
                heir.attempt = reg.attempts.next(st.job.id, self.generation)  # for an answer before its run
                assert w.telemetry is not None
                # the heir's trace continues its own record's (the producer's traceparent in its headers)
                key, headers = st.waiter_records.get((tp, off), (st.job.id, None))
                heir.tele = w.telemetry.job(st.job.id, tp.topic, tp.partition, off, key, headers, st.received_at)
                if st.lora is not None:
                    heir.tele.set_lora(st.lora.lora_name)
                reg.jobs[st.job.id] = heir
                # still tokenizing when abandoned: the heir tokenizes here (rare: a duplicate on
                # another partition during a revoke)
                w.intake.queue(heir, w.intake.precheck(heir) if st.params is None else None)
        for tp in lost:
            self.tracker.drop(tp)
            self._restarts_due.pop(tp, None)

    async def commit_loop(self) -> None:
        w = self.w
        while not w.closed:
            await asyncio.sleep(w.settings.commit_interval_ms / 1000)
            try:
                await self.commit()
            except Exception:  # noqa: BLE001 - offsets must keep moving whatever one round hit
                log.exception("commit round failed")

    async def commit(self) -> None:
        w = self.w
        assigned = w.consumer.assignment()
        mine = await self.check_shrunk([tp for tp in self.tracker.partitions() if tp in assigned and tp not in self._restarts_due])
        mine = await self.check_witnesses(mine)
        c, f = await kc.commit(w.consumer, self.tracker, mine, self.same_topic)
        w.stats.commits += c
        w.stats.commit_failures += f
