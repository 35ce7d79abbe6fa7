"""The worker end to end through Kafka with ``QWORKER_TENSOR_PARALLEL_SIZE=2`` (a `qworker run`
process whose engine spawns one follower rank; gloo on CPU), on a tiny random Llama whose heads
split unevenly: every job is answered and committed; then a follower SIGKILLed while jobs run
makes the worker exit non-zero within seconds with no offset committed past an unanswered job,
and a replacement worker answers every job.

One TP worker for the module (spawns cost seconds on 2 cores); every process it started is
killed by pid at teardown, followers included (they also exit by themselves when their leader
is gone)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from qworker.broker import free_port
from qworker.messages import Job, Sampling
from qworker.worker.client import create_topics, parse, submit

from .conftest import REPO, Results, committed, engine_available, make_settings, model_dir, wait_committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.skipif(not engine_available(), reason="engine or model missing")]

ENV_FIELDS = ("bootstrap_servers", "group_id", "jobs_topic", "tokens_topic", "completions_topic", "dlq_topic", "cancel_topic",
              "session_timeout_ms", "heartbeat_interval_ms", "fetch_max_wait_ms", "commit_interval_ms", "stream_interval_ms", "linger_ms",
              "request_timeout_ms")


class Worker:
    def __init__(self, name: str, settings, model: Path, log_dir: Path, tp: int):
        self.name, self.settings, self.model, self.tp = name, settings, model, tp
        self.log = log_dir / f"{name}.log"
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.seen: set[int] = set()  # every pid of its process tree seen, killed at the end

    def start(self) -> Worker:
        env = dict(os.environ)
        env.update({f"QWORKER_{f.upper()}": str(getattr(self.settings, f)) for f in ENV_FIELDS})
        env.update(QWORKER_ENABLE_IDEMPOTENCE="false", QWORKER_MODEL=str(self.model), QWORKER_HTTP_PORT=str(self.port),
                   QWORKER_HTTP_HOST="127.0.0.1", QWORKER_KV_CACHE_MEMORY="8MiB", QWORKER_DRAIN_TIMEOUT_S="30",
                   QWORKER_TENSOR_PARALLEL_SIZE=str(self.tp), QWORKER_TP_TIMEOUT_S="20")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "qworker.cli", "run"], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        return self

    def followers(self) -> list[psutil.Process]:
        """The spawned ranks: children running multiprocessing's spawn entry (not its resource tracker)."""
        try:
            kids = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        out = [k for k in kids if "spawn_main" in " ".join(k.cmdline())]
        self.seen.update(k.pid for k in kids)
        return out

    def metric(self, name: str) -> float:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2).read().decode()
        except OSError:
            return -1
        for ln in body.splitlines():
            if ln.startswith(name + " ") or ln.startswith(name + "{"):
                return float(ln.split()[-1])
        return -1

    async def wait_metric(self, name: str, pred, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not pred(self.metric(name)):
            assert self.proc.poll() is None, f"{self.name} exited: {self.log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{self.name}: {name}; log: {self.log.read_text()[-2000:]}"
            await asyncio.sleep(0.2)

    def kill_all(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.followers()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in self.seen:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from tests.engine.family_models import build_family_model

    return build_family_model("llama", tmp_path_factory.mktemp("tp-worker-model"), model_dir(), hidden_size=96, num_attention_heads=6,
                              num_key_value_heads=3, intermediate_size=95)


def jobs(prefix: str, n: int, max_tokens: int) -> list[Job]:
    return [Job(id=f"{prefix}{i}", prompt=f"Count to {i}:", sampling=Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for i in range(n)]


async def job_offsets(s, partitions: int = 4) -> dict[int, list[tuple[int, str]]]:
    """(offset, job id) of every record of the jobs topic, per partition."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from qworker.worker.rawfetch import fetch_raw

    c = AIOKafkaConsumer(bootstrap_servers=s.bootstrap_servers, group_id=None, enable_auto_commit=False, fetch_max_wait_ms=20)
    await c.start()
    try:
        await c.topics()
        out: dict[int, list[tuple[int, str]]] = {}
        for p in range(partitions):
            recs, at = [], 0
            while batch := await fetch_raw(c, TopicPartition(s.jobs_topic, p), at, max_wait_ms=20):
                recs += [(r.offset, parse(r.value)["id"]) for r in batch]
                at = batch[-1].offset + 1
            out[p] = recs
        return out
    finally:
        await c.stop()


async def test_tp2_worker_answers_every_job_then_dies_cleanly_with_its_follower(broker, tiny_model, tmp_path) -> None:
    s = make_settings(broker.bootstrap, session_timeout_ms=4000)
    await create_topics(s, partitions=4)
    w = Worker("tp2", s, tiny_model, tmp_path, tp=2).start()
    replacement: Worker | None = None
    r = await Results(s).start()
    try:
        await w.wait_metric("qworker:assigned_partitions", lambda v: v >= 1, 180)
        assert len(w.followers()) == 1
        await submit(s, jobs("ok", 6, 6))
        await r.wait(lambda: sum(1 for k in r.completions if k.startswith("ok")) == 6, 120, "6 completions from the TP=2 worker")
        for k, msgs in r.completions.items():
            assert all(m["type"] == "completion" for m in msgs), msgs
        await wait_committed(s)
        assert w.metric("qworker:tensor_parallel_size") == 2 and w.metric("qworker:tp_allreduce_calls_total") > 0

        # a follower dies while jobs run: the worker exits non-zero, nothing unanswered committed
        await submit(s, jobs("kill", 8, 800))
        await w.wait_metric("qworker:running_jobs", lambda v: v >= 1, 60)
        (follower,) = w.followers()
        follower.kill()
        killed = time.monotonic()
        rc = await asyncio.to_thread(w.proc.wait, 60)
        took = time.monotonic() - killed
        assert rc != 0, w.log.read_text()[-3000:]
        assert took < 30, f"the worker took {took:.1f} s to exit"
        assert "tensor-parallel executor failed" in w.log.read_text()
        await asyncio.sleep(1.0)  # results acknowledged before a commit are readable by now
        answered = set(r.completions)
        offsets, done = await job_offsets(s), await committed(s)
        for p, recs in offsets.items():
            behind = [jid for off, jid in recs if off < (done[p] or 0) and jid not in answered]
            assert not behind, f"partition {p}: committed {done[p]} past unanswered jobs {behind}"
        assert any(k.startswith("kill") and k not in answered for k in (jid for recs in offsets.values() for _, jid in recs)), \
            "the kill came too late: every job was already answered"
        await asyncio.to_thread(lambda: [psutil.wait_procs([psutil.Process(p)], timeout=10) for p in w.seen if psutil.pid_exists(p)])
        assert not psutil.pid_exists(follower.pid) or psutil.Process(follower.pid).status() == psutil.STATUS_ZOMBIE

        replacement = Worker("replacement", s, tiny_model, tmp_path, tp=1).start()
        await r.wait(lambda: sum(1 for k in r.completions if k.startswith("kill")) == 8, 180, "8 completions from the replacement")
        await wait_committed(s, timeout=30)
    finally:
        await r.stop()
        w.kill_all()
        if replacement is not None:
            replacement.kill_all()
