"""Sees a request's swap-out, swap-in and recompute preemption while it produces no output.

A preempted request emits nothing until it runs again, and its delta then shows only that the
preemption count went up. To put ``swap_out``/``swap_in`` events on the ``generate`` span at
about the right time, this task samples the scheduling state of the requests it tracks every
``interval`` seconds.

Thread safety: the engine thread owns the request objects; we only read one attribute per
sequence (``status``) and one counter, each an atomic read under the GIL, from a snapshot of
the sequence list. A transition shorter than one tick can be missed; the delta-based count in
``GenerationTrace.on_output`` then still records the preemption (mode unknown).
Cost: nothing when no span is recording (``track`` ignores those), O(tracked requests) per tick
otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from qworker.telemetry.genai import GenerationTrace

log = logging.getLogger(__name__)


def request_state(request: Any) -> str:
    """``swapped`` if any sequence is swapped out, ``waiting`` if any waits (not started or
    preempted by recompute), else ``running``."""
    states = {getattr(s.status, "value", s.status) for s in tuple(request.seqs)}
    if "swapped" in states:
        return "swapped"
    if "waiting" in states:
        return "waiting"
    return "running"


class StateWatcher:
    def __init__(self, lookup: Callable[[str], Any | None], interval: float = 0.05):
        """``lookup(request_id)`` returns the engine's live request or None (e.g.
        ``async_engine.engine.requests.get``)."""
        self.lookup = lookup
        self.interval = interval
        self._tracked: dict[str, GenerationTrace] = {}
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def track(self, request_id: str, gen: GenerationTrace) -> None:
        if gen.recording:
            self._tracked[request_id] = gen
            self._wake.set()

    def untrack(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="qworker-state-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    def poll(self) -> None:
        """One sample of every tracked request (also what the tests call directly)."""
        for rid, gen in list(self._tracked.items()):
            req = self.lookup(rid)
            if req is None or not getattr(req, "seqs", None):
                continue  # not added yet, or finished: the deltas cover both ends
            # a request waits before its first schedule too; only a running one can be preempted
            state = request_state(req)
            if state == "waiting" and req.metrics.num_preemptions == 0:
                continue
            gen.on_state(state, req.metrics.num_preemptions)

    async def _run(self) -> None:
        while True:
            if not self._tracked:
                self._wake.clear()
                await self._wake.wait()  # idle: no ticking while nothing is traced
            await asyncio.sleep(self.interval)
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - telemetry must never take the worker down
                log.debug("state watcher poll failed", exc_info=True)
