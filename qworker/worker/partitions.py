"""Partitions: what this member owns of the jobs topic, and the offsets it may commit.

Owns the ``OffsetTracker`` (per partition: offsets seen, finished, committed), the group
``generation``, whether the consumer has ``joined`` and the partitions revoked since the last
assignment. Invariants:

- A partition's committed offset only moves past records whose answers the broker acknowledged.
- On a rebalance, jobs keep running until the assignment says which partitions actually moved;
  the lost ones' unfinished jobs are abandoned without committing (their next owner reruns them).
- A kept partition whose group offset went below ours (log reset) starts afresh: its in-flight
  jobs still answer, but mark no offsets of the new log. So do those the checks before each
  commit round find reset (``log_resets``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiokafka import TopicPartition
from aiokafka.errors import KafkaError

from qworker.worker import consumer as kc
from qworker.worker.jobs import JobState
from qworker.worker.log_resets import LogResets
from qworker.worker.offsets import OffsetTracker

if TYPE_CHECKING:
    from qworker.worker.app import Worker

log = logging.getLogger("qworker.worker")
# how long a rebalance may wait, in all, for the group's offsets of the partitions it keeps
KEPT_CHECK_TIMEOUT_S = 5.0

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
        self.resets = LogResets(self)
        # each partition's log end when this pod took it (None until its first fetch): the records
        # below it may have been answered by the previous owner (their offsets not yet committed)
        self.log_ends: dict[TopicPartition, int | None] = {}

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit what is done before ownership may move. Jobs keep running until we learn, in
        ``on_assigned``, which partitions actually moved (an eager rebalance revokes all)."""
        w = self.w
        w.stats.rebalances += 1
        self.epoch += 1
        self.revoked |= revoked
        # not those whose log was found reset or short: the offset we hold belongs to the old log
        c, f = await kc.commit(w.consumer, self.tracker, list(revoked - self.resets.withheld()), self.resets.same_topic)
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
        restarted = await self.check_kept(assigned)
        taken = assigned - set(self.tracker.partitions())
        self.log_ends.update(dict.fromkeys(taken))  # their ends come with their first fetch (note_log_ends)
        await self.resets.on_assigned(taken, restarted)
        if w.pauser is not None and w.pauser.paused:
            w.consumer.pause(*assigned)  # a rebalance clears pauses
        log.info("assigned %s (generation %d)", sorted(f"{tp.topic}/{tp.partition}" for tp in assigned), self.generation)

    async def check_kept(self, assigned: set[TopicPartition]) -> set[TopicPartition]:
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
        restarted = set()
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
            self.resets.forget(tp)  # the rebalance already placed it at the group's offset
            restarted.add(tp)
        return restarted

    def note_log_ends(self) -> None:
        """After each poll: the log end of each partition taken since, from the first fetch that
        reports its high watermark (ListOffsets under-reports on some brokers: Tansu's after a
        batched produce). Until then every record there counts as possibly answered before."""
        for tp in [tp for tp in self.log_ends if self.log_ends[tp] is None]:
            end = self.w.consumer.highwater(tp)
            if end is not None:
                self.log_ends[tp] = end

    def maybe_answered_before(self, tp: TopicPartition, offset: int) -> bool:
        """Whether the record at ``offset`` was in ``tp``'s log when this pod took the partition
        (or that is not known): a previous owner may have answered it, its offset not committed
        yet. A record that arrived later is new to every pod (a resubmitted id's, say)."""
        end = self.log_ends.get(tp)
        return end is None or offset < end

    def start_afresh(self, tp: TopicPartition, why: str) -> None:
        """Forget what we saw of ``tp``'s log: its jobs in flight still answer but mark no offset."""
        log.warning("%s/%d: %s; starting the partition afresh", tp.topic, tp.partition, why)
        self.log_ends[tp] = None  # the new log's end comes with the next fetch
        for st in self.w.registry.jobs.values():
            st.waiters = [wt for wt in st.waiters if wt[0] != tp]
            if st.tp == tp:
                st.tp = DETACHED
        self.tracker.drop(tp)

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
                heir.maybe_answered = self.maybe_answered_before(tp, off)
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
            self.resets.forget(tp)

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
        mine = await self.resets.committable([tp for tp in self.tracker.partitions() if tp in assigned])
        c, f = await kc.commit(w.consumer, self.tracker, mine, self.resets.same_topic)
        w.stats.commits += c
        w.stats.commit_failures += f
