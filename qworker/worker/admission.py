"""Admission control: which queued jobs the engine may take now.

Jobs wait in a bounded local queue (highest priority first, then arrival). A job is handed to
the engine only when the KV cache has room for its prompt plus the tokens it will generate
(capped by ``reserve_tokens`` per job, because the engine can preempt when guesses are wrong)
after what the jobs already admitted may still grow. When the local queue is full the
consumer pauses its partitions, so unstarted jobs stay in Kafka where their lag is visible to
the autoscaler instead of piling up in this process's memory.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class CapacityLike(Protocol):
    free_tokens: int
    num_running: int
    num_waiting: int
    total_tokens: int


class Admittable(Protocol):
    @property
    def prompt_len(self) -> int: ...
    @property
    def max_new_tokens(self) -> int: ...  # n * max_tokens
    @property
    def generated(self) -> int: ...  # tokens generated so far (all choices)


J = TypeVar("J")


@dataclass(slots=True)
class Admission:
    max_waiting: int  # bound on jobs queued here and on jobs waiting inside the engine
    reserve_tokens: int = 256  # growth reserved per job, at most

    def growth(self, job: Admittable) -> int:
        return max(0, min(job.max_new_tokens, self.reserve_tokens) - job.generated)

    def can_admit(self, job: Admittable, cap: CapacityLike, admitted: Iterable[Admittable]) -> bool:
        """``admitted``: jobs already handed to the engine and not finished.

        The engine learns of a new request asynchronously (its step thread picks it up between
        steps), so its capacity lags behind our admissions. Jobs that have not produced a token
        yet are therefore charged their whole prompt here (maybe twice, which errs on the safe
        side) and count against the waiting bound.
        """
        admitted = list(admitted)
        if not admitted:
            return True  # an idle engine always takes one job, however large: progress first
        unstarted = [j for j in admitted if j.generated == 0]
        if len(unstarted) >= self.max_waiting or cap.num_waiting >= self.max_waiting:
            return False
        reserved = sum(self.growth(j) for j in admitted) + sum(j.prompt_len for j in unstarted)
        need = job.prompt_len + min(job.max_new_tokens, self.reserve_tokens)
        return cap.free_tokens - reserved >= need

    def should_pause(self, queued: int, paused: bool) -> bool:
        """Pause when the local queue is full; resume once it is half empty (no flapping)."""
        if paused:
            return queued > self.max_waiting // 2
        return queued >= self.max_waiting


class PendingQueue(Generic[J]):
    """Jobs fetched but not yet admitted, lowest ``priority`` first, FIFO within a priority."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, J]] = []
        self._seq = itertools.count()
        self._removed: set[int] = set()
        self._ids: dict[int, int] = {}  # id(job) -> seq, for lazy removal

    def push(self, priority: int, job: J) -> None:
        seq = next(self._seq)
        self._ids[id(job)] = seq
        heapq.heappush(self._heap, (priority, seq, job))

    def _skip_removed(self) -> None:
        while self._heap and self._heap[0][1] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[1])

    def peek(self) -> J | None:
        self._skip_removed()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> J:
        self._skip_removed()
        job = heapq.heappop(self._heap)[2]
        self._ids.pop(id(job), None)
        return job

    def remove(self, job: J) -> bool:
        seq = self._ids.pop(id(job), None)
        if seq is None:
            return False
        self._removed.add(seq)
        return True

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[J]:
        return iter([j for _, s, j in self._heap if s not in self._removed])
