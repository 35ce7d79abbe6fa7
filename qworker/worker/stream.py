"""Coalesce a job's token deltas into stream events and publish them without gaps or repeats."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson
from aiokafka.errors import KafkaError

from qworker.messages import Delta, Usage, dumps

log = logging.getLogger(__name__)


class StreamEnd(Delta):
    """Not a native message (native streams never carry one): the end of choice ``index`` with
    its ``finish_reason``, or (``usage`` set) the run's usage, for wire formats that stream them
    (OpenAI's chunks). It takes a ``seq`` like any event, so the stream stays gap-free."""

    finish_reason: str | None = None
    usage: Usage | None = None


# Renders one event: its value and extra headers (the native format is ``dumps`` and none).
Render = Callable[[Delta], tuple[bytes, list[tuple[str, bytes]]]]


@dataclass(slots=True)
class _Buf:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class StreamCoalescer:
    """Buffers deltas per choice; ``take`` turns them into ``Delta`` events with consecutive ``seq``.

    ``seq`` counts events of one ``run_id`` from 0 with no gaps, so a reader can tell a missing
    event from a late one. The first tokens go out at once (time to first token matters); later
    ones wait until ``interval_s`` has passed since the previous flush. Everything taken is
    remembered per choice, so ``restart`` can replay the stream under a fresh ``run_id``.
    """

    def __init__(self, job_id: str, attempt: int, run_id: str, interval_s: float):
        self.job_id, self.attempt, self.run_id, self.interval_s = job_id, attempt, run_id, interval_s
        self.seq = 0
        self._bufs: dict[int, _Buf] = {}
        self._taken: dict[int, list[tuple[str, list[int]]]] = {}  # per choice, per event taken
        self._ends: list[tuple[int, str | None, Usage | None]] = []  # not taken yet
        self._taken_ends: list[tuple[int, str | None, Usage | None]] = []
        self._last_flush = float("-inf")

    @property
    def last_seq(self) -> int | None:
        """The ``seq`` of the last event taken (None before the first): the completion's end
        marker for its stream."""
        return self.seq - 1 if self.seq > 0 else None

    def add(self, index: int, text: str, token_ids: list[int]) -> None:
        if not text and not token_ids:
            return
        b = self._bufs.setdefault(index, _Buf())
        b.text.append(text)
        b.token_ids.extend(token_ids)

    def end(self, finish_reasons: dict[int, str], usage: Usage | None = None) -> None:
        """Close the stream with one ``StreamEnd`` per choice (then one with the usage): taken
        after everything buffered, replayed after everything taken."""
        self._ends.extend((i, r, None) for i, r in sorted(finish_reasons.items()))
        if usage is not None:
            self._ends.append((-1, None, usage))

    def due(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return bool(self._bufs) and now - self._last_flush >= self.interval_s

    def _event(self, index: int, text: str, token_ids: list[int]) -> Delta:
        ev = Delta(job_id=self.job_id, attempt=self.attempt, run_id=self.run_id, index=index, seq=self.seq, text=text, token_ids=token_ids)
        self.seq += 1
        return ev

    def _end_event(self, index: int, reason: str | None, usage: Usage | None) -> StreamEnd:
        ev = StreamEnd(job_id=self.job_id, attempt=self.attempt, run_id=self.run_id, index=index, seq=self.seq, text="", token_ids=[], finish_reason=reason, usage=usage)
        self.seq += 1
        return ev

    def take(self, now: float | None = None) -> list[Delta]:
        """All buffered deltas as events (empty when nothing is buffered), then any ends."""
        events: list[Delta] = []
        for index in sorted(self._bufs):
            b = self._bufs[index]
            ev = self._event(index, "".join(b.text), list(b.token_ids))
            events.append(ev)
            self._taken.setdefault(index, []).append((ev.text, ev.token_ids))
        self._bufs.clear()
        events.extend(self._end_event(*e) for e in self._ends)
        self._taken_ends.extend(self._ends)
        self._ends = []
        self._last_flush = time.monotonic() if now is None else now
        return events

    def restart(self, run_id: str, max_event_bytes: int = 256 * 1024) -> list[Delta]:
        """Start the stream again as ``run_id``: per choice, everything taken so far, in as few
        events as keep each under about ``max_event_bytes`` (seq from 0); later ``take`` calls
        continue that numbering."""
        self.run_id, self.seq = run_id, 0
        events = []
        for index, pieces in sorted(self._taken.items()):
            text: list[str] = []
            ids: list[int] = []
            size = 0
            for t, tids in pieces:
                n = _json_len(t) + 12 * len(tids)  # as the text is escaped in JSON; ids' digits and commas, generously
                if (text or ids) and size + n > max_event_bytes:
                    events.append(self._event(index, "".join(text), ids))
                    text, ids, size = [], [], 0
                text.append(t)
                ids.extend(tids)
                size += n
            events.append(self._event(index, "".join(text), ids))
        events.extend(self._end_event(*e) for e in self._taken_ends)
        return events


def _json_len(text: str) -> int:
    """Bytes ``text`` takes inside a JSON message as ``dumps`` writes it: control characters,
    quotes and backslashes are escaped (``\\u0000`` is 6 bytes for 1), and lone surrogates make
    ``dumps`` fall back to ASCII-only escapes."""
    try:
        return len(orjson.dumps(text)) - 2
    except orjson.JSONEncodeError:
        return len(json.dumps(text, ensure_ascii=True)) - 2


# Room for a delta's envelope (ids, field names) and its headers (traceparent, tracestate).
_ENVELOPE = 4096


class StreamSender:
    """Publishes one run's delta events in ``seq`` order.

    Invariant: for the ``run_id`` a completion names, each ``seq`` from 0 up is on the topic
    exactly once, with nothing missing. A send that could not even be enqueued is retried (it
    never reached the broker). A send whose acknowledgement failed is ambiguous: the broker may
    have written it anyway (a stalled broker times out, then appends the request it had read),
    so resending it could repeat a ``seq``. ``settle`` therefore replays the whole stream under a
    fresh ``run_id`` instead; events of the abandoned id are stale, like those of an aborted run.
    """

    def __init__(self, publisher, topic: str, coalescer: StreamCoalescer, headers: list | None, render: Render | None = None, log_extra: dict | None = None):
        self.publisher, self.topic, self.coalescer, self.headers = publisher, topic, coalescer, headers
        self.render = render  # None: native Delta messages
        self.log_extra = log_extra or {"job_id": coalescer.job_id}  # the job (and trace) ids on its log lines
        self._sent: list[asyncio.Future] = []
        self._lock = asyncio.Lock()
        self.restarts = 0

    @property
    def run_id(self) -> str:
        return self.coalescer.run_id

    async def _send_all(self, events: list[Delta]) -> None:
        for ev in events:
            if self.render is None:
                value, headers = dumps(ev), self.headers
            else:
                value, extra = self.render(ev)
                headers = [*(self.headers or []), *extra] or None
            self._sent.append(await self.publisher.send(self.topic, ev.job_id, value, headers))

    async def flush(self) -> None:
        async with self._lock:  # one flush at a time keeps events in seq order on the wire
            await self._send_all(self.coalescer.take())

    async def stop_ticker(self, ticker: asyncio.Task) -> BaseException | None:
        """Cancel ``ticker`` (a task that calls ``flush``) between two of its flushes, never inside
        one: cut between taking its events (their seq numbers given) and enqueuing them, it would
        lose them for good, a gap under the completion's last_seq (helper-123). Returns what
        ended it (its exception, or the CancelledError)."""
        try:
            async with self._lock:
                ticker.cancel()
        finally:
            ticker.cancel()  # the caller cancelled while it waited: the ticker must not outlive it
        (res,) = await asyncio.gather(ticker, return_exceptions=True)
        return res

    async def settle(self) -> None:
        """Flush the rest and wait until every event of the current ``run_id`` is acknowledged."""
        await self.flush()
        while True:
            async with self._lock:
                sent, self._sent = self._sent, []
                failed = None
                for fut in sent:
                    try:
                        await fut
                    except KafkaError as e:
                        failed = e
                if failed is None:
                    return
                self.restarts += 1
                new_id = uuid.uuid4().hex[:16]
                log.warning("stream of run %s: delivery failed (%r); replaying it as run %s", self.run_id, failed, new_id, extra=self.log_extra)
                await self.publisher.wait_retry(self.topic, failed, 0.2, self.coalescer.job_id)  # raises when stopping
                # each replayed event must fit the size limit the original events were sent under
            limit = getattr(self.publisher, "max_message_bytes", None) or 1_000_000
            await self._send_all(self.coalescer.restart(new_id, max(1024, min(256 * 1024, limit - _ENVELOPE))))
