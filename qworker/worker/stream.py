"""Coalesce a job's token deltas into stream events (one per choice per flush interval)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from qworker.messages import Delta


@dataclass(slots=True)
class _Buf:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class StreamCoalescer:
    """Buffers deltas per choice; ``take`` turns them into ``Delta`` events with consecutive ``seq``.

    ``seq`` counts events of one run from 0 with no gaps, so a reader can tell a missing event
    from a late one. The first tokens go out at once (time to first token matters); later ones
    wait until ``interval_s`` has passed since the previous flush.
    """

    def __init__(self, job_id: str, attempt: int, run_id: str, interval_s: float):
        self.job_id, self.attempt, self.run_id, self.interval_s = job_id, attempt, run_id, interval_s
        self.seq = 0
        self._bufs: dict[int, _Buf] = {}
        self._last_flush = float("-inf")

    def add(self, index: int, text: str, token_ids: list[int]) -> None:
        if not text and not token_ids:
            return
        b = self._bufs.setdefault(index, _Buf())
        b.text.append(text)
        b.token_ids.extend(token_ids)

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return bool(self._bufs) and now - self._last_flush >= self.interval_s

    def take(self, now: float | None = None) -> list[Delta]:
        """All buffered deltas as events (empty when nothing is buffered)."""
        events = []
        for index in sorted(self._bufs):
            b = self._bufs[index]
            events.append(
                Delta(job_id=self.job_id, attempt=self.attempt, run_id=self.run_id, index=index, seq=self.seq, text="".join(b.text), token_ids=b.token_ids)
            )
            self.seq += 1
        self._bufs.clear()
        self._last_flush = time.monotonic() if now is None else now
        return events
