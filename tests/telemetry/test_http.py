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
