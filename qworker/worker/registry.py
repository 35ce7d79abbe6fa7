"""The jobs this worker holds: by id (pending, validating and running) and the pending queue.

Owns ``jobs`` (one ``JobState`` per job id; a duplicate record attaches to it as a waiter, a
cancel finds it here), the bounded priority ``pending`` queue, the attempt counter and the
``wake`` event that tells admission to look again (new jobs queued, or room freed). A job
leaves ``jobs`` exactly once, through ``forget``, and only the state that is still registered
under its id is removed (an heir that replaced it after a revoke stays).
"""

from __future__ import annotations

import asyncio

from qworker.worker.admission import PendingQueue
from qworker.worker.jobs import Attempts, JobState


class Registry:
    def __init__(self) -> None:
        self.jobs: dict[str, JobState] = {}  # by job id: pending and running
        self.pending: PendingQueue[JobState] = PendingQueue()
        self.attempts = Attempts()  # each answer to an id gets a higher attempt than the one before
        self.wake: asyncio.Event | None = None  # made on the worker's loop at start

    def poke(self) -> None:
        if self.wake is not None:
            self.wake.set()

    def forget(self, st: JobState) -> None:
        if self.jobs.get(st.job.id) is st:
            del self.jobs[st.job.id]
        self.poke()  # its KV room may admit the next job

    def running(self) -> list[JobState]:
        return [st for st in self.jobs.values() if st.admitted]

    def busy(self) -> bool:
        """Work is in flight: only then does a stale engine stamp mean a stuck engine."""
        return any(st.admitted for st in self.jobs.values())
