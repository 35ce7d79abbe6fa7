"""The jobs consumer: group membership, rebalance callbacks, pausing, offset commits."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
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
    """The group generation (it grows with every rebalance); used as a run's ``attempt``."""
    coord = getattr(consumer, "_coordinator", None)
    gen = getattr(coord, "generation", -1)
    return gen if isinstance(gen, int) and gen >= 0 else 0


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


async def commit(consumer: AIOKafkaConsumer, tracker: OffsetTracker[TopicPartition], tps: list[TopicPartition] | None = None) -> tuple[int, int]:
    """Commit every partition whose finished prefix grew. Returns (commits, failures).

    A failed commit is only logged: the offsets stay in the tracker and the next round retries;
    if the partition moved meanwhile, its new owner reruns those jobs (at-least-once)."""
    offsets = tracker.to_commit(tps)
    if not offsets:
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
