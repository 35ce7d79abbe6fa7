"""``qworker broker --port P`` restarts on the same port at once after a stop.

A stopped broker leaves the connections it closed in TIME_WAIT on its own port for about a
minute; a free-port check that binds without SO_REUSEADDR took that for "in use" and refused to
start, although the broker itself (which sets SO_REUSEADDR, as servers do) could listen there."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from qworker.broker import HOST, free_port, port_free

from .conftest import REPO

pytestmark = pytest.mark.timeout(120)


def _time_wait_on(port: int) -> bool:
    """Whether a TCP socket on local ``HOST:port`` is in TIME_WAIT (Linux /proc/net/tcp)."""
    want = f"{socket.htonl(0x7F000001):08X}:{port:04X}"
    try:
        rows = open("/proc/net/tcp").read().splitlines()[1:]
    except OSError:
        pytest.skip("no /proc/net/tcp")
    return any(r.split()[1] == want and r.split()[3] == "06" for r in rows)


def test_port_with_time_wait_connections_is_free_but_a_listener_is_not() -> None:
    port = free_port()
    server = socket.create_server((HOST, port))
    client = socket.create_connection((HOST, port))
    conn, _ = server.accept()
    assert not port_free(port)  # listening: taken
    conn.close()  # the server side closes first, so its end of the connection goes to TIME_WAIT
    assert client.recv(1) == b""
    client.close()
    server.close()
    assert _time_wait_on(port), "the test needs a TIME_WAIT socket on the port"
    assert port_free(port)


def _start(port: int) -> tuple[subprocess.Popen, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")}
    proc = subprocess.Popen([sys.executable, "-m", "qworker.cli", "broker", "--port", str(port), "--partitions", "1"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    seen: list[str] = []
    while not any(ln.startswith("  export ") for ln in seen):
        line = proc.stdout.readline().decode()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
    return proc, seen


def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_broker_restarts_on_the_same_port_right_after_a_stop() -> None:
    port = free_port()
    first, seen = _start(port)
    try:
        assert first.poll() is None, seen
        # a client still connected when the broker stops (a worker, a submit): the broker closes
        # the connection first, which leaves TIME_WAIT on the broker's port
        client = socket.create_connection((HOST, port))
        assert _stop(first) == 0
        client.settimeout(10)
        assert client.recv(1) == b""
        client.close()
    finally:
        _stop(first)
    deadline = time.monotonic() + 5
    while not _time_wait_on(port) and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel moves the socket to TIME_WAIT once both FINs are acked
    assert _time_wait_on(port), "the test needs a TIME_WAIT socket on the port"
    second, seen = _start(port)
    try:
        assert second.poll() is None, "".join(seen)
        assert any(f"QWORKER_BOOTSTRAP_SERVERS={HOST}:{port}" in ln for ln in seen)
        socket.create_connection((HOST, port), timeout=2).close()
        assert _stop(second) == 0
    finally:
        _stop(second)
