"""Which offsets may be committed, per partition.

A committed offset ``c`` for a partition means: every job record below ``c`` is finished — its
completion, error or DLQ entry was published and acknowledged by the broker — so a new owner
of the partition may start reading at ``c`` without losing a job. Records at or above ``c``
may already be finished too; they are rerun after a crash (at-least-once).

A partition is also withheld from commits while its log is *suspect*: after a connection to the
broker broke, the broker may have come back with a new log whose offsets continue past ours
(memory storage restarted, a topic re-created) while its records are not the ones we read. The
last record read before the break (its offset and fingerprint, the *witness*; for a partition
not read yet in this ownership, the record before the group's offset, its *baseline*) is then
compared with what the log now holds at that offset before the partition is committed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, TypeVar

TP = TypeVar("TP", bound=Hashable)


@dataclass(slots=True)
class _Partition:
    high: int  # one past the highest offset seen; every offset below it was seen by us
    pending: set[int] = field(default_factory=set)
    committed: int | None = None  # last offset we committed (or learned was committed)
    last_read: tuple[int, int] | None = None  # (offset, fingerprint) of the last record read that has one


def fingerprint(timestamp: int, key: bytes | None, value: bytes | None) -> int:
    """What tells two records at one offset apart: a new log's record has its own timestamp and,
    almost always, its own job. Only compared within this process."""
    return hash((timestamp, key, value))


def record_fingerprint(record: Any) -> int:
    """``fingerprint`` of a record as aiokafka gives it or as ``rawfetch`` reads it."""
    return fingerprint(record.timestamp, record.key, record.value)


class OffsetTracker(Generic[TP]):
    """Tracks seen and unfinished offsets; ``committable`` is the lowest unfinished one.

    Fetches are sequential per partition, so "seen" is simply ``offset < high``. After a
    rebalance the consumer rewinds to the committed offset and refetches records we already
    hold; ``add`` returns False for those so they are not started twice.
    """

    def __init__(self) -> None:
        self._parts: dict[TP, _Partition] = {}
        self._baselines: dict[TP, tuple[int, int]] = {}  # (offset, fingerprint) before the group's offset
        self._witnesses: dict[TP, tuple[int, int]] = {}  # what the log must still hold before a commit

    def add(self, tp: TP, offset: int, fingerprint: int | None = None) -> bool:
        """Record a fetched offset as unfinished; False when it was already seen. ``fingerprint``
        (see ``fingerprint``) makes the record the partition's witness after a broken connection."""
        p = self._parts.get(tp)
        if p is None:
            p = self._parts[tp] = _Partition(high=offset)
        if offset < p.high:
            return False
        # Offsets may skip (compaction, transaction markers): the gap holds no job.
        p.high = offset + 1
        p.pending.add(offset)
        if fingerprint is not None:
            p.last_read = (offset, fingerprint)
        return True

    def done(self, tp: TP, offset: int) -> None:
        """Mark a record finished (its result is acknowledged). Unknown partitions are ignored:
        the partition was revoked meanwhile and its new owner decides."""
        p = self._parts.get(tp)
        if p is not None:
            p.pending.discard(offset)

    def committable(self, tp: TP) -> int | None:
        """The offset to commit: the first unfinished one, or one past everything seen."""
        p = self._parts.get(tp)
        if p is None:
            return None
        return min(p.pending) if p.pending else p.high

    def to_commit(self, tps: list[TP] | None = None) -> dict[TP, int]:
        """Partitions whose committable offset moved past the last commit (suspect ones never)."""
        out: dict[TP, int] = {}
        for tp in self._parts if tps is None else tps:
            c = self.committable(tp)
            p = self._parts.get(tp)
            if c is not None and p is not None and tp not in self._witnesses and (p.committed is None or c > p.committed):
                out[tp] = c
        return out

    def set_baseline(self, tp: TP, offset: int, fingerprint: int) -> None:
        """The record before the group's offset of a partition just assigned: its witness until
        a record of it is read."""
        self._baselines[tp] = (offset, fingerprint)

    def suspect(self, tp: TP) -> None:
        """``tp``'s log may have been replaced: suspect until its witness is checked. A witness
        already waiting is kept: it is older, and what was read since is suspect too."""
        p = self._parts.get(tp)
        known = (p.last_read if p is not None else None) or self._baselines.get(tp)
        if known is not None:
            self._witnesses.setdefault(tp, known)

    def suspect_all(self) -> None:
        """A connection broke: every partition's log may have been replaced."""
        for tp in self._parts.keys() | self._baselines.keys():
            self.suspect(tp)

    def witness(self, tp: TP) -> tuple[int, int] | None:
        """(offset, fingerprint) the log must still hold before ``tp`` is committed; None if none."""
        return self._witnesses.get(tp)

    def vouched(self, tp: TP) -> None:
        """The log still holds the witness: ``tp`` may be committed again."""
        self._witnesses.pop(tp, None)

    def mark_committed(self, offsets: dict[TP, int]) -> None:
        for tp, off in offsets.items():
            p = self._parts.get(tp)
            if p is not None and (p.committed is None or off > p.committed):
                p.committed = off

    def last_committed(self, tp: TP) -> int | None:
        """The offset we last committed for ``tp`` (None if none in this ownership)."""
        p = self._parts.get(tp)
        return p.committed if p else None

    def seen_up_to(self, tp: TP) -> int | None:
        """One past the highest offset seen of ``tp`` (None if none in this ownership)."""
        p = self._parts.get(tp)
        return p.high if p else None

    def pending(self, tp: TP) -> set[int]:
        p = self._parts.get(tp)
        return set(p.pending) if p else set()

    def num_pending(self) -> int:
        return sum(len(p.pending) for p in self._parts.values())

    def drop(self, tp: TP) -> None:
        """Forget a partition we no longer own; its unfinished records are the new owner's."""
        self._parts.pop(tp, None)
        self._baselines.pop(tp, None)
        self._witnesses.pop(tp, None)

    def partitions(self) -> list[TP]:
        return list(self._parts)
