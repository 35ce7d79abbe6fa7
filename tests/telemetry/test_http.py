"""/healthz, /readyz and /metrics on the raw-asyncio server, over real loopback sockets."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

from qworker.telemetry.http import EngineLiveness, TelemetryServer
from qworker.telemetry.metrics import WorkerMetrics


async def get(port: int, path: str, method: str = "GET", extra: str = "") -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, body


async def idle_client(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that starts a request and never finishes its head."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\n")  # and never the rest
    return reader, writer


async def test_probes_and_metrics():
    engine = SimpleNamespace(last_step_time=time.monotonic())
    state = {"model": True, "warm": False, "group": True}
    metrics = WorkerMetrics("smol", stats=lambda: {"num_running": 3, "kv_usage": 0.5})
    metrics.job_outcome("completed")
    server = TelemetryServer(
        "127.0.0.1",
        0,
        metrics=metrics,
        liveness={"engine_loop": EngineLiveness(engine, threshold_s=1.0)},
        readiness={name: (lambda n=name: state[n]) for name in state},
    )
    await server.start()
    try:
        status, _, body = await get(server.port, "/healthz")
        assert status == 200 and json.loads(body) == {"status": "ok", "checks": {"engine_loop": True}}
        engine.last_step_time -= 5  # the loop stopped stamping: stuck
        status, _, body = await get(server.port, "/healthz")
        assert status == 503 and json.loads(body)["checks"]["engine_loop"] is False

        status, _, body = await get(server.port, "/readyz")
        assert status == 503 and json.loads(body)["checks"] == {"model": True, "warm": False, "group": True}
        state["warm"] = True
        status, _, _ = await get(server.port, "/readyz?verbose=1")
        assert status == 200

        status, headers, body = await get(server.port, "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain")
        assert int(headers["content-length"]) == len(body)
        text = body.decode()
        assert 'qworker:num_requests_running{model_name="smol"} 3.0' in text
        assert 'qworker:jobs_total{code="",model_name="smol",outcome="completed"} 1.0' in text

        status, headers, body = await get(server.port, "/metrics", "HEAD")
        assert status == 200 and body == b"" and int(headers["content-length"]) > 0
        assert (await get(server.port, "/nope"))[0] == 404
        assert (await get(server.port, "/healthz", "POST"))[0] == 405
    finally:
        await server.stop()


async def test_a_raising_check_fails_the_probe():
    def boom() -> bool:
        raise RuntimeError("consumer gone")

    server = TelemetryServer("127.0.0.1", 0, readiness={"group": boom})
    await server.start()
    try:
        status, _, body = await get(server.port, "/readyz")
        assert status == 503 and json.loads(body)["checks"] == {"group": False}
        assert (await get(server.port, "/metrics"))[0] == 404  # no metrics configured
    finally:
        await server.stop()


async def test_a_stalled_client_does_not_block_others():
    """A client that connects and sends nothing must not hold up the loop or other probes."""
    server = TelemetryServer("127.0.0.1", 0, liveness={"ok": lambda: True})
    await server.start()
    try:
        idle_reader, idle = await asyncio.open_connection("127.0.0.1", server.port)
        idle.write(b"GET /heal")  # an incomplete request line
        status, _, _ = await get(server.port, "/healthz")
        assert status == 200
        # the stalled connection was still being read while the probe was answered (a server that
        # served one client at a time would have dropped it first): it completes now
        idle.write(b"thz HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = await asyncio.wait_for(idle_reader.read(), 5)
        assert raw.split(b" ", 2)[1] == b"200", raw[:80]
        idle.close()
    finally:
        await server.stop()


async def test_slow_metrics_render_runs_off_the_loop():
    """The exposition runs in a thread: a slow engine stats() does not freeze the event loop."""

    entered, release = threading.Event(), threading.Event()
    released: list[bool] = []

    def slow_stats() -> dict:
        # blocks until the event loop releases it: rendered on the loop, it would wait in vain
        entered.set()
        released.append(release.wait(30))
        return {}

    server = TelemetryServer("127.0.0.1", 0, metrics=WorkerMetrics("smol", stats=slow_stats))
    await server.start()
    try:
        scrape = asyncio.create_task(get(server.port, "/metrics"))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        release.set()  # runs only if the loop is free while stats() blocks
        status, _, _ = await scrape
        assert status == 200 and released == [True]
    finally:
        await server.stop()


async def test_a_client_sending_its_head_slowly_is_dropped_at_the_deadline(monkeypatch):
    """One header line every 0.3 s kept a connection (and its file descriptor) for as long as the
    client liked: the time limit was per line. The whole head now has one deadline."""
    monkeypatch.setattr("qworker.telemetry.http._READ_TIMEOUT_S", 1.0)
    server = TelemetryServer("127.0.0.1", 0, liveness={"ok": lambda: True})
    await server.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        t0 = time.monotonic()
        closed_after = None
        for i in range(20):  # 6 s of header lines, each well inside the old per-line limit
            await asyncio.sleep(0.3)
            try:
                writer.write(f"X-{i}: y\r\n".encode())
                await writer.drain()
            except ConnectionError:
                closed_after = time.monotonic() - t0
                break
            if await _eof_within(reader, 0.0):
                closed_after = time.monotonic() - t0
                break
        writer.close()
        assert closed_after is not None and closed_after < 3.0, closed_after
    finally:
        await server.stop()


async def _eof_within(reader: asyncio.StreamReader, timeout: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), max(timeout, 0.01)) == b""
    except asyncio.TimeoutError:
        return False
    except ConnectionError:
        return True


async def test_a_flood_of_idle_connections_is_bounded_and_probes_are_still_answered(monkeypatch):
    """Slow clients held one file descriptor each without bound (1,100 of them starved the
    worker's Kafka client of sockets and the probes timed out): beyond MAX_CONNECTIONS a new
    connection closes the oldest ones that have been open for MIN_AGE_S; a probe amid a burst of
    younger connections is answered (helper-73: closing by arrival alone aborted probes that
    arrived just before a burst)."""
    from qworker.telemetry import http

    monkeypatch.setattr(http, "MAX_CONNECTIONS", 16)
    monkeypatch.setattr(http, "MIN_AGE_S", 0.5)
    server = TelemetryServer("127.0.0.1", 0, liveness={"ok": lambda: True})
    await server.start()
    clients = []

    async def idle_clients(n: int) -> None:
        for _ in range(n):
            clients.append(await idle_client(server.port))

    try:
        await idle_clients(40)
        status, _, body = await get(server.port, "/healthz")  # amid 40 young connections
        assert status == 200 and json.loads(body)["status"] == "ok"
        await asyncio.sleep(0.6)  # all 40 are old now
        await idle_clients(1)
        await asyncio.sleep(0.1)
        assert len(server._open) <= 16
        closed = [await _eof_within(r, 1.0) for r, _ in clients[:25]]
        assert all(closed), f"{closed.count(False)} of the oldest still open"
        assert not await _eof_within(clients[-1][0], 0.2), "the newest connection was closed"
        status, _, _ = await get(server.port, "/healthz")
        assert status == 200
    finally:
        for _, w in clients:
            w.close()
        await server.stop()


async def test_a_burst_faster_than_min_age_is_held_to_the_hard_cap_and_stop_ends_every_handler(monkeypatch):
    """helper-82: connections younger than MIN_AGE_S were never closed, so a burst (200 every
    50 ms) held ~1,000 descriptors and asyncio's accept hit EMFILE; and stop() left the handlers
    of open connections for the loop's shutdown to cancel, one logged traceback each. Now beyond
    HARD_CAP open connections a newer one is closed at once, and stop() closes every connection and
    lets its handler end."""
    from qworker.telemetry import http

    monkeypatch.setattr(http, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(http, "HARD_CAP", 12)
    monkeypatch.setattr(http, "MIN_AGE_S", 30.0)  # none ages out during the test
    server = TelemetryServer("127.0.0.1", 0, liveness={"ok": lambda: True})
    await server.start()
    clients = []
    try:
        for _ in range(30):
            clients.append(await idle_client(server.port))
            await asyncio.sleep(0.005)
            assert len(server._open) <= 12
        await asyncio.sleep(0.1)
        assert len(server._open) == 12 and len(server._handlers) == 12
        closed = [await _eof_within(r, 0.5) for r, _ in clients[12:]]
        assert all(closed), f"{closed.count(False)} connections past the hard cap still open"
        handlers = set(server._handlers)
        await server.stop()
        assert not server._handlers and all(t.done() and not t.cancelled() for t in handlers)
        assert all([await _eof_within(r, 0.5) for r, _ in clients[:12]])
    finally:
        for _, w in clients:
            w.close()
        await server.stop()


async def test_startupz_passes_only_once_the_model_is_loaded():
    """The chart's startup probe hit /healthz, which passes while the model loads (liveness holds
    then), so its load budget bounded nothing: a load that hung was never restarted. /startupz
    adds the startup checks to liveness."""
    state = {"model_loaded": False, "alive": True}
    server = TelemetryServer("127.0.0.1", 0, liveness={"alive": lambda: state["alive"]},
                             startup={"model_loaded": lambda: state["model_loaded"]})
    await server.start()
    try:
        assert (await get(server.port, "/healthz"))[0] == 200
        status, _, body = await get(server.port, "/startupz")
        assert status == 503 and json.loads(body)["checks"] == {"alive": True, "model_loaded": False}
        state["model_loaded"] = True
        assert (await get(server.port, "/startupz"))[0] == 200
        state["alive"] = False
        assert (await get(server.port, "/startupz"))[0] == 503
    finally:
        await server.stop()


async def test_connections_left_from_a_burst_do_not_lock_out_later_probes(monkeypatch):
    """helper-113: a burst up to HARD_CAP, left open, refused every later probe even once the
    burst was old enough to be closed (the cap was applied before the old ones were closed), so
    anyone who could reach the port could fail the pod's liveness probe."""
    from qworker.telemetry import http

    monkeypatch.setattr(http, "MAX_CONNECTIONS", 8)
    monkeypatch.setattr(http, "HARD_CAP", 12)
    monkeypatch.setattr(http, "MIN_AGE_S", 0.3)
    server = TelemetryServer("127.0.0.1", 0, liveness={"ok": lambda: True})
    await server.start()
    clients = []
    try:
        for _ in range(12):
            clients.append(await idle_client(server.port))
        await asyncio.sleep(0.1)
        assert len(server._open) == 12
        await asyncio.sleep(0.4)  # the whole burst is past MIN_AGE_S now
        for _ in range(3):
            status, _, body = await get(server.port, "/healthz")
            assert status == 200 and json.loads(body)["status"] == "ok"
        assert len(server._open) <= 8
    finally:
        for _, w in clients:
            w.close()
        await server.stop()


async def test_a_malformed_accept_header_gets_the_default_metrics_format():
    """helper-113: ``Accept: application/openmetrics-text; version=abc`` made prometheus_client
    raise: a 500 and a logged traceback per request."""
    metrics = WorkerMetrics("smol", stats=lambda: {"num_running": 1})
    server = TelemetryServer("127.0.0.1", 0, metrics=metrics)
    await server.start()
    try:
        _, plain_headers, plain = await get(server.port, "/metrics")
        for accept in ("application/openmetrics-text; version=abc", "text/plain; version=x.y"):
            status, headers, body = await get(server.port, "/metrics", extra=f"Accept: {accept}\r\n")
            assert status == 200 and headers["content-type"] == plain_headers["content-type"], (accept, status)
            assert b"qworker" in body
    finally:
        await server.stop()
