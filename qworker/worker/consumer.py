"""The jobs consumer: group membership, rebalance callbacks, pausing, offset commits."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.cluster import ClusterMetadata
from aiokafka.conn import CloseReason
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from qworker.worker.offsets import OffsetTracker

log = logging.getLogger(__name__)


class Listener(ConsumerRebalanceListener):
    """Forwards rebalance callbacks. aiokafka awaits them before the next fetch, so they must
    not wait on anything the poll loop holds (aiokafka's consumer.rst warns of the deadlock)."""

    def __init__(self, revoked: Callable[[set[TopicPartition]], Awaitable[None]], assigned: Callable[[set[TopicPartition]], Awaitable[None]]):
        self._revoked, self._assigned = revoked, assigned

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._assigned(set(assigned))


def generation(consumer: AIOKafkaConsumer) -> int:
    """The group generation (it grows with every rebalance); the base of a run's ``attempt``."""
    coord = getattr(consumer, "_coordinator", None)
    gen = getattr(coord, "generation", -1)
    return gen if isinstance(gen, int) and gen >= 0 else 0


def on_log_may_have_changed(consumer: AIOKafkaConsumer, callback: Callable[[], None]) -> None:
    """Call ``callback`` whenever a partition's log may have been replaced under the same
    offsets: one of the consumer's connections broke or timed out (the broker behind it may
    have restarted without its data), or a metadata update shows a subscribed partition with
    another leader (a failover; an unclean one truncates) or gone (a topic deleted, perhaps to be
    re-created). Must be called before the consumer starts. Wraps the client's own close
    handler, which every connection is given when it opens, and listens to its cluster metadata
    (private attributes: aiokafka offers no hook)."""
    client = consumer._client  # noqa: SLF001
    own = client._on_connection_closed  # noqa: SLF001

    def closed(conn: object, reason: CloseReason) -> None:
        if reason in (CloseReason.CONNECTION_BROKEN, CloseReason.CONNECTION_TIMEOUT):
            callback()
        own(conn, reason)

    leaders: dict[TopicPartition, int | None] | None = None  # None: no metadata seen yet

    def metadata_updated(cluster: ClusterMetadata) -> None:
        nonlocal leaders
        now = {TopicPartition(topic, p): cluster.leader_for_partition(TopicPartition(topic, p))
               for topic in consumer.subscription() for p in cluster.partitions_for_topic(topic) or ()}
        if leaders is not None and now != leaders:  # a leader moved, or partitions came or went
            callback()
        leaders = now

    client._on_connection_closed = closed  # noqa: SLF001
    client.cluster.add_listener(metadata_updated)


class Pauser:
    """Pauses or resumes every assigned partition; ``apply`` is idempotent and cheap, and is
    called before each poll, because a rebalance silently clears pauses."""

    def __init__(self, consumer: AIOKafkaConsumer):
        self.consumer = consumer
        self.paused = False

    def apply(self, want: bool) -> bool:
        """Returns True when this call switched from running to paused."""
        assigned = self.consumer.assignment()
        if want:
            todo = set(assigned) - set(self.consumer.paused())
            if todo:
                self.consumer.pause(*todo)
        else:
            if self.consumer.paused():
                self.consumer.resume(*self.consumer.paused())
        switched = want and not self.paused
        self.paused = want
        return switched


async def commit(consumer: AIOKafkaConsumer, tracker: OffsetTracker[TopicPartition], tps: list[TopicPartition] | None = None,
                 vouch: Callable[[], Awaitable[bool]] | None = None) -> tuple[int, int]:
    """Commit every partition whose finished prefix grew. Returns (commits, failures).

    ``vouch``, when given, is asked after the offsets are taken and before they are committed
    (whether the log they were read from is still there); False skips the round.
    A failed commit is only logged: the offsets stay in the tracker and the next round retries;
    if the partition moved meanwhile, its new owner reruns those jobs (at-least-once)."""
    offsets = tracker.to_commit(tps)
    if not offsets or (vouch is not None and not await vouch()):
        return 0, 0
    try:
        await consumer.commit(offsets)
    except (CommitFailedError, IllegalStateError, KafkaError) as e:
        log.warning("commit of %s failed: %r", {f"{tp.topic}/{tp.partition}": o for tp, o in offsets.items()}, e)
        return 0, 1
    tracker.mark_committed(offsets)
    return 1, 0


_rotation = itertools.count()


async def getmany(consumer: AIOKafkaConsumer, timeout_ms: int, max_records: int) -> dict[TopicPartition, list]:
    """``consumer.getmany`` that never drops records when one partition cannot be decoded.

    aiokafka drains the fetched partitions one after another and moves each one's position as it
    goes; when a later partition raises (a header key that is not UTF-8), the records already
    drained from earlier ones are lost with the exception, their positions already past them.
    So: drain one partition per call (an error then loses nothing: the raising partition's
    position has not moved, and what other partitions gave is returned first; the error recurs
    on the next call), and wait for new data with ``max_records=1``, which returns as soon as
    any one partition gave a record."""
    out: dict[TopicPartition, list] = {}
    left = max_records
    tps = sorted(consumer.assignment(), key=lambda t: (t.topic, t.partition))
    if tps:  # start at a different partition each call: a busy one must not starve the rest
        k = next(_rotation) % len(tps)
        tps = tps[k:] + tps[:k]
    for tp in tps:
        if left <= 0:
            break
        try:
            recs = (await consumer.getmany(tp, timeout_ms=0, max_records=left)).get(tp, [])
        except Exception:
            if out:
                return out  # hand over what was drained; this partition raises again next time
            raise
        if recs:
            out[tp] = recs
            left -= len(recs)
    if out:
        return out
    return await consumer.getmany(timeout_ms=timeout_ms, max_records=1)


class GroupHealth:
    """Whether the jobs consumer really works now: /readyz's ``in_group`` check.

    A flag set when the group was first joined stays true with the broker frozen or gone
    (aiokafka notices a dead coordinator only after ``request_timeout_ms`` plus the session
    timeout: 80 s observed). So readiness is what was *confirmed* lately: a round
    (every ``interval_s``) passes when the group coordinator is known, the assignment is
    current (joined, no rebalance pending), the coordinator answers a request (the group's
    committed offset of one partition) within ``timeout_s``, and every assigned partition that
    is not paused got a fetch response within ``bound_s``. Ready while the last passing round
    is at most ``bound_s`` old: a frozen or vanished broker turns the pod unready within about
    ``bound_s + interval_s``, and one passing round after its return makes it ready again. A
    short rebalance (under ``bound_s``) does not flap it.
    """

    def __init__(self, consumer: AIOKafkaConsumer, probe: TopicPartition, bound_s: float, clock: Callable[[], float] = time.monotonic):
        self.consumer, self.probe, self.bound_s, self.clock = consumer, probe, bound_s, clock
        self.interval_s = min(5.0, bound_s / 4)
        self.timeout_s = max(0.1, bound_s / 2)
        self.last_ok: float | None = None
        self.reason = "not checked yet"  # why the last round failed (for logs)

    def ready(self) -> bool:
        return self.last_ok is not None and self.clock() - self.last_ok <= self.bound_s

    async def run(self) -> None:
        """The checking loop; never ends (the worker runs it with its other loops)."""
        was_ready = False
        while True:
            passed = False
            try:
                passed = await self.check()
            except Exception as e:  # noqa: BLE001 - a failed round is a failed round, never the end
                self.reason = f"check failed: {e!r}"
            if passed:
                self.last_ok = self.clock()
            if self.ready() != was_ready:
                was_ready = not was_ready
                if was_ready:
                    log.info("consumer confirmed its group state with the broker: ready")
                else:
                    log.warning("consumer unready: %s (nothing confirmed for %.1fs)", self.reason, self.bound_s)
            # after a failed round, look again soon: a pod that just joined (or a broker that just
            # came back) should not wait a whole interval to be ready
            await asyncio.sleep(self.interval_s if passed else min(self.interval_s, 0.5))

    async def check(self) -> bool:
        """One round; True when everything above holds now (``reason`` says what did not)."""
        coord = getattr(self.consumer, "_coordinator", None)
        if coord is None or coord.coordinator_id is None:
            self.reason = "group coordinator unknown"
            return False
        subscription = self.consumer._subscription.subscription
        if subscription is None or coord.need_rejoin(subscription):
            self.reason = "not joined, or rejoining the group"
            return False
        try:
            async with asyncio.timeout(self.timeout_s):
                await self.consumer.committed(self.probe)
        except TimeoutError:
            self.reason = f"the group coordinator did not answer within {self.timeout_s:.1f}s"
            return False
        except KafkaError as e:
            self.reason = f"the group coordinator refused a request: {e!r}"
            return False
        now_ms = time.time() * 1000
        paused = set(self.consumer.paused())
        for tp in self.consumer.assignment():
            last = self.consumer.last_poll_timestamp(tp) if tp not in paused else None
            if last is not None and now_ms - last > self.bound_s * 1000:
                self.reason = f"no fetch response for {tp.topic}/{tp.partition} for {(now_ms - last) / 1000:.1f}s"
                return False
        return True
