"""One small HTTP/1.1 server for probes and metrics: ``/healthz``, ``/startupz``, ``/readyz``,
``/metrics``.

Raw asyncio streams, one request per connection. It must never stall the worker's event loop
nor take what the worker needs: a request's head is read under one deadline and a size bound;
beyond ``MAX_CONNECTIONS`` open connections a new one closes the oldest that has been open for
``MIN_AGE_S`` (so slow clients cannot hold the file descriptors the Kafka client needs, while a
probe, which is answered within milliseconds, is not the one closed amid a modest burst); a
burst that keeps ``HARD_CAP`` connections younger than that open has each newer one closed at
once, so the server never holds more descriptors than that; probe checks are plain callables
that must be cheap (they run on the loop), and the metrics exposition (which calls the engine's
``stats()`` and formats every series) runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from qworker.telemetry.metrics import WorkerMetrics

log = logging.getLogger(__name__)

Check = Callable[[], bool]
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 400: "Bad Request", 500: "Internal Server Error", 503: "Service Unavailable"}
_MAX_HEADER_LINES = 100
_READ_TIMEOUT_S = 5.0  # for a whole request head, and for writing the answer
MAX_CONNECTIONS = 128
MIN_AGE_S = 1.0  # a connection younger than this is not closed for a newer one, below HARD_CAP
HARD_CAP = 2 * MAX_CONNECTIONS  # open connections, whatever their age: a newer one is closed at once
_STOP_WAIT_S = 1.0  # for the connections' handlers to end once stop() closed their connections


class EngineLiveness:
    """Liveness of the engine loop: ``AsyncEngine``'s thread stamps ``last_step_time``
    (monotonic) after every step and every idle tick (0.5 s), so a stamp older than
    ``threshold_s`` means the loop is stuck (a step hung, or the thread died). The threshold must
    exceed the longest step. ``busy`` (optional) limits the verdict to times when work is in
    flight, for engines whose idle loop does not tick; ``engine`` may be a callable returning
    the engine, or None while the model loads (alive: the startup probe covers loading)."""

    def __init__(self, engine: Any, threshold_s: float = 60.0, busy: Callable[[], bool] | None = None):
        self._engine = engine
        self.threshold_s = threshold_s
        self.busy = busy

    def _get(self) -> Any:
        return self._engine() if callable(self._engine) else self._engine

    def age(self) -> float:
        eng = self._get()
        last = getattr(eng, "last_step_time", None)
        return 0.0 if last is None else time.monotonic() - last

    def __call__(self) -> bool:
        if self.age() < self.threshold_s:
            return True
        return self.busy is not None and not self.busy()


def _run_checks(checks: Mapping[str, Check]) -> tuple[bool, dict[str, bool]]:
    results: dict[str, bool] = {}
    for name, check in checks.items():
        try:
            results[name] = bool(check())
        except Exception:  # noqa: BLE001 - a raising check is a failing check
            log.debug("check %s raised", name, exc_info=True)
            results[name] = False
    return all(results.values()), results


class TelemetryServer:
    """Serves ``/healthz`` (all ``liveness`` checks), ``/startupz`` (the ``liveness`` and the
    ``startup`` checks, e.g. model loaded: a startup probe that passes only then bounds the time a
    load may take), ``/readyz`` (all ``readiness`` checks, e.g. model loaded, warm-up done,
    consumer in its group) and ``/metrics``.

    Each probe answers 200 or 503 with a JSON body naming every check, so an operator can see
    which one failed. ``port=0`` picks a free port (read ``.port`` after ``start``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        metrics: WorkerMetrics | None = None,
        liveness: Mapping[str, Check] | None = None,
        readiness: Mapping[str, Check] | None = None,
        startup: Mapping[str, Check] | None = None,
    ):
        self.host, self.port = host, port
        self.metrics = metrics
        self.liveness = dict(liveness or {})
        self.readiness = dict(readiness or {})
        self.startup = {**self.liveness, **(startup or {})}
        self._server: asyncio.base_events.Server | None = None
        self._open: dict[asyncio.StreamWriter, float] = {}  # open connections -> when, oldest first
        self._handlers: set[asyncio.Task] = set()  # one per open connection (see stop)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=16 * 1024)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("telemetry http on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        """Stops listening and closes the open connections, letting their handlers end (the
        loop's shutdown would otherwise cancel each and asyncio log a traceback per connection)."""
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._open):
            writer.transport.abort()  # its handler reads the end of the stream and returns
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=_STOP_WAIT_S)
        await self._server.wait_closed()
        self._server = None

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]]:
        line = (await reader.readline()).decode("latin-1")
        headers: dict[str, str] = {}
        for _ in range(_MAX_HEADER_LINES):
            raw = await reader.readline()
            if raw in (b"\r\n", b"\n", b""):
                break
            name, _, value = raw.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        parts = line.split()
        if len(parts) < 2:
            return "", "", headers
        return parts[0], parts[1].split("?", 1)[0], headers

    async def _respond(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str, bytes]:
        if not method:
            return 400, "text/plain", b"bad request\n"
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n"
        if path == "/healthz":
            return self._probe(self.liveness)
        if path == "/readyz":
            return self._probe(self.readiness)
        if path == "/startupz":
            return self._probe(self.startup)
        if path == "/metrics" and self.metrics is not None:
            body, ctype = await asyncio.to_thread(self.metrics.render, headers.get("accept"))
            return 200, ctype, body
        return 404, "text/plain", b"not found\n"

    @staticmethod
    def _probe(checks: Mapping[str, Check]) -> tuple[int, str, bytes]:
        ok, results = _run_checks(checks)
        body = json.dumps({"status": "ok" if ok else "fail", "checks": results}).encode() + b"\n"
        return (200 if ok else 503), "application/json", body

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        now = time.monotonic()
        # room first (old connections closed for this one), then the cap: connections left over
        # from a burst are closed once they are old enough, not held against every newcomer
        while len(self._open) >= MAX_CONNECTIONS:
            oldest, since = next(iter(self._open.items()))
            if now - since < MIN_AGE_S:
                break  # a burst: those younger are bounded by HARD_CAP
            del self._open[oldest]
            oldest.transport.abort()  # its reader sees the connection lost and ends
        if len(self._open) >= HARD_CAP:  # a burst faster than MIN_AGE_S lets us close older ones
            writer.transport.abort()
            return
        self._open[writer] = now
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        try:
            method, path, headers = await asyncio.wait_for(self._read_head(reader), _READ_TIMEOUT_S)
            if writer.transport.is_closing():
                return  # closed for a newer connection while it was still sending its request
            try:
                status, ctype, body = await self._respond(method, path, headers)
            except Exception:  # noqa: BLE001 - report, keep serving
                log.exception("telemetry http handler failed for %s", path)
                status, ctype, body = 500, "text/plain", b"internal error\n"
            head = f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))
            await asyncio.wait_for(writer.drain(), _READ_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass  # slow, broken or oversized client: drop it
        finally:
            self._open.pop(writer, None)
            self._handlers.discard(task)
            writer.close()
