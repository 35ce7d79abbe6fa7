"""Worker processes (`qworker run`) with the real model: group split, kill -9, SIGTERM drain.

One pair of workers serves the whole module (each model load costs seconds on 2 cores)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from qworker.broker import free_port
from qworker.messages import Job, Sampling
from qworker.worker.client import create_topics, submit

from .conftest import KV_BYTES, REPO, Results, engine_available, model_dir, make_settings, wait_committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.skipif(not engine_available(), reason="engine or model missing")]


class WorkerProc:
    def __init__(self, name: str, settings, log_dir: Path):
        self.name, self.settings, self.log = name, settings, log_dir / f"{name}.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> WorkerProc:
        s = self.settings
        env = dict(os.environ)
        for field in ("bootstrap_servers", "group_id", "jobs_topic", "tokens_topic", "completions_topic", "dlq_topic", "cancel_topic",
                      "session_timeout_ms", "heartbeat_interval_ms", "fetch_max_wait_ms", "commit_interval_ms", "stream_interval_ms", "linger_ms", "request_timeout_ms"):
            env[f"QWORKER_{field.upper()}"] = str(getattr(s, field))
        env.update(QWORKER_ENABLE_IDEMPOTENCE="false", QWORKER_MODEL=str(model_dir()), QWORKER_HTTP_PORT=str(self.port), QWORKER_HTTP_HOST="127.0.0.1",
                   QWORKER_KV_CACHE_MEMORY=str(KV_BYTES), QWORKER_DRAIN_TIMEOUT_S="60", QWORKER_MAX_WAITING_JOBS="8")
        with open(self.log, "ab") as out:
            # -X faulthandler: a worker stuck at a failure dumps every thread's stack (see logs)
            self.proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "qworker.cli", "run"], env=env, cwd=REPO, stdout=out,
                                         stderr=subprocess.STDOUT)
        return self

    def metrics(self) -> dict[str, float]:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2).read().decode()
        except OSError:
            return {}
        return {ln.split()[0]: float(ln.split()[1]) for ln in body.splitlines() if ln and not ln.startswith("#")}

    async def wait_metric(self, name: str, pred, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not pred(self.metrics().get(name, -1)):
            assert self.proc is not None and self.proc.poll() is None, f"{self.name} exited: {self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.name}: {name} never satisfied; log: {self.log.read_text()[-2000:]}"
            await asyncio.sleep(0.2)

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


@pytest.fixture(scope="module")
def cluster(broker, tmp_path_factory):
    s = make_settings(broker.bootstrap, session_timeout_ms=4000)
    asyncio.run(create_topics(s, partitions=4))
    logs = tmp_path_factory.mktemp("workers")
    procs = {"a": WorkerProc("a", s, logs).start(), "b": WorkerProc("b", s, logs).start()}
    yield s, procs
    for p in procs.values():
        p.stop()


def logs(procs: dict[str, WorkerProc]) -> str:
    """Every worker's log tail, for a failure message (a stuck worker says why only there). A
    worker still running is sent SIGABRT first, so its log ends with every thread's stack."""
    for p in procs.values():
        if p.proc is not None and p.proc.poll() is None:
            p.proc.send_signal(signal.SIGABRT)
            try:
                p.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
    return "\n".join(f"--- {p.name} (rc {p.proc.poll() if p.proc else None}):\n{p.log.read_text()[-6000:]}" for p in procs.values())


async def wait_or_show_logs(r: Results, procs: dict[str, WorkerProc], pred, timeout: float, what: str) -> None:
    try:
        await r.wait(pred, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{logs(procs)}") from None


def jobs(prefix: str, n: int, max_tokens: int) -> list[Job]:
    return [Job(id=f"{prefix}{i}", prompt=f"Count to {i}:", sampling=Sampling(max_tokens=max_tokens, temperature=0.0)) for i in range(n)]


async def test_two_workers_split_partitions_100_jobs(cluster) -> None:
    s, procs = cluster
    for p in procs.values():
        await p.wait_metric("qworker:assigned_partitions", lambda v: v >= 1, 120)
    r = await Results(s).start()
    try:
        await submit(s, jobs("split", 100, 2))
        await wait_or_show_logs(r, procs, lambda: sum(1 for k in r.completions if k.startswith("split")) == 100, 120, "100 completions")
        assert all(v[0]["type"] == "completion" for k, v in r.completions.items() if k.startswith("split"))
        got = {name: p.metrics().get("qworker:records_total", 0) for name, p in procs.items()}
        assert all(v > 0 for v in got.values()), f"one worker got nothing: {got}"
        assert sum(p.metrics()["qworker:assigned_partitions"] for p in procs.values()) == 4
        await wait_committed(s)
    finally:
        await r.stop()


async def test_kill9_with_jobs_in_flight_every_job_completes(cluster) -> None:
    s, procs = cluster
    a = procs["a"]
    await a.wait_metric("qworker:assigned_partitions", lambda v: v >= 1, 120)
    r = await Results(s).start()
    try:
        await submit(s, jobs("kill", 40, 8))
        await a.wait_metric("qworker:running_jobs", lambda v: v >= 1, 60)
        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait(10)
        procs["a"] = WorkerProc("a2", s, a.log.parent).start()  # restarted pod
        await wait_or_show_logs(r, procs, lambda: sum(1 for k in r.completions if k.startswith("kill")) == 40, 150, "40 completions after kill -9")
        for k, v in r.completions.items():
            if k.startswith("kill"):
                assert {m["job_id"] for m in v} == {k} and all(m["type"] == "completion" for m in v)  # duplicates possible, same id
        await wait_committed(s)
    finally:
        await r.stop()


async def test_sigterm_drains_and_exits_zero(cluster) -> None:
    s, procs = cluster
    b = procs["b"]
    await b.wait_metric("qworker:assigned_partitions", lambda v: v >= 1, 120)
    r = await Results(s).start()
    try:
        await submit(s, jobs("term", 24, 8))
        await b.wait_metric("qworker:running_jobs", lambda v: v >= 1, 60)
        b.proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(b.proc.wait, 90)
        assert rc == 0, b.log.read_text()[-3000:]
        assert "drain: committed; leaving the group" in b.log.read_text()
        await wait_or_show_logs(r, procs, lambda: sum(1 for k in r.completions if k.startswith("term")) == 24, 150, "24 completions after SIGTERM")
        await wait_committed(s)
    finally:
        await r.stop()
