"""An adversarial pass over the third review's worker fixes: bad start-up settings, hostile
records, the stream's end marker and attempts. Each test failed before its fix (the docstrings
say how); through the real CLI, the real Tansu broker and the real or tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import REPO, Results
from .test_flow import engines, job, one_torch_thread, started  # noqa: F401 - fixtures
from .test_review3 import _produce

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------ start-up: one line, exit 2
def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")}
    env.update({"QWORKER_HTTP_PORT": "-1", "QWORKER_BOOTSTRAP_SERVERS": "127.0.0.1:1", "QWORKER_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}, **extra)
    return env


def _bad_config_model(tmp: Path) -> Path:
    d = tmp / "broken-model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"')  # cut short: not JSON
    return d


def _cases(tmp: Path, tiny: Path) -> dict[str, tuple[dict[str, str], str]]:
    cases: dict[str, tuple[dict[str, str], str]] = {
        "broken config.json": ({"QWORKER_MODEL": str(_bad_config_model(tmp))}, "QWORKER_MODEL="),
        # the tiny model's blocks are 4 KiB: 1e-9 of any machine's memory holds fewer than two
        "KV fraction under two blocks": ({"QWORKER_MODEL": str(tiny), "QWORKER_KV_CACHE_MEMORY": "0.000000001"}, "QWORKER_KV_CACHE_MEMORY="),
        "unknown trace exporter": ({"QWORKER_MODEL": str(tiny), "OTEL_TRACES_EXPORTER": "bogus"}, "OTEL_TRACES_EXPORTER"),
        "probe host not of this machine": ({"QWORKER_MODEL": str(tiny), "QWORKER_HTTP_PORT": "0", "QWORKER_HTTP_HOST": "999.1.1.1"}, "QWORKER_HTTP_HOST"),
    }
    import torch

    if not torch.cuda.is_available():
        cases["cuda on a CPU machine"] = ({"QWORKER_MODEL": str(tiny), "QWORKER_DEVICE": "cuda"}, "QWORKER_DEVICE='cuda'")
    return cases


def test_engine_failures_at_start_are_one_line_and_exit_2(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Before: anything the engine raised while loading (a KV budget under two blocks, a CUDA
    device on a CPU machine - told as a pinned-memory error -, a config.json that is not JSON),
    and an OTEL_TRACES_EXPORTER the tracer does not know, left ``qworker run`` with a 30-line
    traceback and exit 1; a probe host that is not an address of the machine was blamed on
    QWORKER_HTTP_PORT."""
    procs = {
        name: (subprocess.Popen([sys.executable, "-m", "qworker.cli", "run"], cwd=REPO, env=_clean_env(**env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE), names)
        for name, (env, names) in _cases(tmp_path, tiny_model_dir).items()
    }
    for name, (p, names) in procs.items():
        out, err = p.communicate(timeout=240)
        lines = [ln for ln in err.decode().splitlines() if ln.strip() and "Warning" not in ln and not ln.startswith("  warnings.warn")]
        assert p.returncode == 2, (name, p.returncode, err.decode()[-2000:])
        assert "Traceback" not in err.decode(), (name, err.decode()[-2000:])
        assert len(lines) == 1 and lines[0].startswith("qworker: ") and names in lines[0], (name, lines)


# ------------------------------------------------------------------ settings checked with the settings
@pytest.mark.parametrize(("var", "value"), [
    ("QWORKER_SESSION_TIMEOUT_MS", "0"), ("QWORKER_HEARTBEAT_INTERVAL_MS", "0"), ("QWORKER_HEARTBEAT_INTERVAL_MS", "999999"),
    ("QWORKER_LINGER_MS", "-1"), ("QWORKER_FETCH_MAX_WAIT_MS", "-1"), ("QWORKER_REQUEST_TIMEOUT_MS", "0"), ("QWORKER_MAX_POLL_INTERVAL_MS", "0"),
    ("QWORKER_DRAIN_TIMEOUT_S", "-1"), ("QWORKER_DRAIN_TIMEOUT_S", "nan"), ("QWORKER_LIVENESS_TIMEOUT_S", "inf"),
    ("QWORKER_READY_TIMEOUT_S", "inf"), ("QWORKER_READY_TIMEOUT_S", "0.000001"),
    ("QWORKER_JOBS_TOPIC", "my jobs"), ("QWORKER_COMPLETIONS_TOPIC", "x" * 250), ("QWORKER_DLQ_TOPIC", ".."),
    ("QWORKER_BOOTSTRAP_SERVERS", "kafka:notaport"), ("QWORKER_BOOTSTRAP_SERVERS", "kafka:9092,:9093"),
    ("QWORKER_DEVICE", "tpu"), ("QWORKER_DEVICE", "cuda:x"),
    ("QWORKER_KAFKA_SASL_MECHANISM", "MD5"), ("QWORKER_KAFKA_SSL_CAFILE", "/nonexistent/ca.pem"),
])
def test_every_bad_setting_is_refused_by_name(var: str, value: str) -> None:
    """Before: each of these was accepted, and the worker then loaded the model and failed
    with a traceback (a topic Kafka refuses, a SASL mechanism or CA file aiokafka refuses, a
    host:port it cannot parse, a device torch does not know), or ran broken: a 0 ms session or
    a heartbeat slower than the session never stays in the group, a negative drain timeout or
    an infinite ready timeout turns a probe off, a microsecond one spins the readiness check."""
    from pydantic import ValidationError

    from qworker.config import WorkerSettings

    with pytest.raises(ValidationError) as e:
        WorkerSettings.from_env({var: value})
    line = WorkerSettings.explain(e.value)
    assert var in line and "\n" not in line, line


def test_good_kafka_settings_still_pass() -> None:
    from qworker.config import WorkerSettings

    s = WorkerSettings.from_env({"QWORKER_BOOTSTRAP_SERVERS": "kafka-0.kafka:9092,10.0.0.1:9093,[::1]:9094,kafka", "QWORKER_JOBS_TOPIC": "team_a.jobs-v1",
                                 "QWORKER_DEVICE": "cuda:1", "QWORKER_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "QWORKER_READY_TIMEOUT_S": "1"})
    assert s.device == "cuda:1" and s.kafka_sasl_mechanism == "SCRAM-SHA-512"


# ------------------------------------------------------------------ a deep record must not stall the loop
async def test_deep_record_is_scanned_off_the_event_loop(topics, results: Results, engines, monkeypatch) -> None:
    """A 4 MB record nested a million deep with an id: the decoders refuse it and the
    recursion-free scan reads it in pure Python (seconds here). Before: on the event loop, so
    heartbeats, streams and probes stopped for as long, per such record. The scan is observed
    (not replaced) to see which thread runs it; the record is still answered."""
    import threading

    from qworker.worker import decode as decode_mod


    threads: list[threading.Thread] = []
    real_scan = decode_mod.scan

    def observed(raw, keys=frozenset()):
        threads.append(threading.current_thread())
        return real_scan(raw, keys)

    monkeypatch.setattr(decode_mod, "scan", observed)
    depth = 1_000_000
    w = await started(topics, await engines())
    try:
        await _produce(topics, b"deep-m", b'{"id": "deep-m", "prompt": "hi", "m": ' + b"[1," * depth + b"1" + b"]" * depth + b"}")
        await results.wait(lambda: "deep-m" in results.completions, 120, "the deep record's answer")
        [c] = results.completions["deep-m"]
        assert c["type"] == "error" and c["error"]["code"] == "invalid_job" and f"{depth + 1} levels" in c["error"]["message"]
        assert threads and all(t is not threading.main_thread() for t in threads), threads
    finally:
        await w.stop()


# ------------------------------------------------------------------ attempts across a worker restart
async def test_attempt_grows_across_a_worker_restart(topics, results: Results, engines) -> None:
    """An id answered by one worker, then resubmitted after that worker stopped and another
    joined the same group: the second answer must carry a higher attempt, or a reader that
    deduplicates by (job id, attempt) drops it as a copy of the first."""
    from qworker.messages import dumps

    eng = await engines()
    w = await started(topics, eng)
    try:
        await _produce(topics, b"again-r", dumps(job("again-r", max_tokens=2)))
        await results.wait(lambda: len(results.completions.get("again-r", [])) == 1, 60, "the first answer")
    finally:
        await w.stop()
    w = await started(topics, eng)
    try:
        await _produce(topics, b"again-r", dumps(job("again-r", max_tokens=3)))
        await results.wait(lambda: len(results.completions.get("again-r", [])) == 2, 60, "the second answer")
    finally:
        await w.stop()
    first, second = results.completions["again-r"]
    assert second["attempt"] > first["attempt"], (first["attempt"], second["attempt"])


def test_attempt_grows_for_an_id_the_memory_forgot() -> None:
    """Before: once 65,536 other ids had been answered, a resubmitted id was forgotten and got
    ``k = 0`` again - the same attempt as its first answer in the same generation."""
    from qworker.worker.jobs import ATTEMPT_SPAN, Attempts

    a = Attempts(max_ids=2)
    first = a.next("x", 5)
    a.next("y", 5)
    a.next("z", 5)  # "x" is forgotten
    assert "x" not in a._last
    again = a.next("x", 5)
    assert again > first
    assert a.next("x", 5) > again  # remembered again: counts on from there
    assert a.next("fresh", 6) == 6 * ATTEMPT_SPAN  # a new generation starts over
    for i in range(5000):  # saturates at the span's top instead of spilling into the next generation
        last = a.next(f"id{i % 3}", 6)
    assert last < 7 * ATTEMPT_SPAN


# ------------------------------------------------------------------ /readyz after the broker is killed and restarted
async def test_readyz_recovers_after_the_broker_is_killed_and_restarted(engines, tmp_path: Path) -> None:
    """kill -9 the broker: /readyz turns 503; start it again on the same port: 200 again (the
    consumer finds the new coordinator and rejoins), and the worker answers a job sent then."""
    import signal

    from qworker.broker import start_broker, stop_broker
    from qworker.messages import dumps
    from qworker.worker.client import create_topics

    from .conftest import make_settings
    from .test_review3 import _wait_status

    broker = start_broker(log_dir=tmp_path)
    try:
        s = make_settings(broker.bootstrap, http_port=0, http_host="127.0.0.1", ready_timeout_s=2.0, request_timeout_ms=3000)
        await create_topics(s, partitions=2)
        w = await started(s, await engines())
        try:
            port = w.http.port
            await _wait_status(port, 200, 60)
            os.kill(broker.proc.pid, signal.SIGKILL)
            broker.proc.wait()
            body = await _wait_status(port, 503, 60)
            assert body["checks"]["in_group"] is False
            broker.start()  # same port; memory storage: the topics are made again
            await create_topics(s, partitions=2)
            await _wait_status(port, 200, 90)
            r = Results(s)
            await r.start()
            try:
                await _produce(s, b"after-restart", dumps(job("after-restart", max_tokens=2)))
                await r.wait(lambda: "after-restart" in r.completions, 90, "a job sent after the restart")
            finally:
                await r.stop()
        finally:
            await w.stop(drain_timeout_s=5)
    finally:
        stop_broker(broker)


# ------------------------------------------------------------------ hostile cancel records
def test_a_cancel_key_longer_than_any_job_id_is_not_remembered() -> None:
    """A cancel without a usable value falls back to its key. Before: any key was taken, so a
    producer on the cancel topic could fill the 100,000-entry registry of every pod with
    megabyte keys (tens of GB), none of which can name a job (ids are at most 256 characters)."""
    from qworker.messages import MAX_ID_LEN
    from qworker.worker.cancellation import parse_cancel

    assert parse_cancel(b"x" * (1 << 20), None) is None
    assert parse_cancel(b"x" * (MAX_ID_LEN + 1), b"not json") is None
    assert parse_cancel("é".encode() * MAX_ID_LEN, None) == "é" * MAX_ID_LEN  # 256 characters, 512 bytes: still an id
    assert parse_cancel(b"job-1", None) == "job-1" and parse_cancel(None, b'{"job_id": "job-2"}') == "job-2"


async def test_a_failed_cancel_is_logged_with_its_job_id(caplog) -> None:
    """Before: ``cancel of <id> failed`` named the job only inside its text, so the JSON log had
    no job_id field to find it by."""
    import logging
    from types import SimpleNamespace

    from qworker.config import WorkerSettings
    from qworker.worker.cancellation import CancelWatcher

    async def refuse(job_id: str, at: float) -> None:
        raise RuntimeError("no")

    w = CancelWatcher("cancel", WorkerSettings().consumer_options(), refuse, 60.0)
    try:
        with caplog.at_level(logging.ERROR, logger="qworker.worker.cancellation"):
            await w._handle(SimpleNamespace(key=b"job-9", value=None, timestamp=None))
        [rec] = [r for r in caplog.records if r.name == "qworker.worker.cancellation"]
        assert rec.job_id == "job-9"
    finally:
        await w.consumer.stop()


# ------------------------------------------------------------------ last_seq with a stop string held back
async def test_last_seq_covers_a_stream_cut_by_a_stop_string(topics, results: Results, engines) -> None:
    """Two choices whose text is cut by a stop string (its first characters are held back while
    they might start it, then dropped): the events of the completion's run, seq 0..last_seq with
    none missing, rebuild exactly each choice's final text."""
    from qworker.messages import Job, Sampling
    from qworker.worker.client import submit

    from .conftest import stream_text

    w = await started(topics, await engines())
    try:
        await submit(topics, [job("free", prompt="tell me", max_tokens=24)])
        await results.wait(lambda: "free" in results.completions, 60, "the free run")
        text = results.completions["free"][0]["choices"][0]["text"]
        stop = text[len(text) // 2: len(text) // 2 + 3]
        assert len(stop) == 3, text
        cut = Job(id="cut", prompt="tell me", stream=True,
                  sampling=Sampling(max_tokens=24, temperature=0.0, ignore_eos=True, n=2, stop=[stop]))
        await submit(topics, [cut])
        await results.wait(lambda: "cut" in results.completions, 60, "the cut run")
        [c] = results.completions["cut"]
        assert c["choices"][0]["finish_reason"] == "stop" and c["choices"][0]["text"] == text[: text.index(stop)]
        def mine() -> list[dict]:
            return [d for d in results.deltas.get("cut", []) if d["run_id"] == c["run_id"]]

        # the events are acknowledged before the completion, but read from another topic
        await results.wait(lambda: len(mine()) >= c["last_seq"] + 1, 30, "the stream's events")
        assert sorted(d["seq"] for d in mine()) == list(range(c["last_seq"] + 1))
        for i in (0, 1):
            assert stream_text(mine(), c["run_id"], i) == c["choices"][i]["text"]
    finally:
        await w.stop()


def test_a_setting_given_as_a_flag_and_as_an_option_is_one_line(monkeypatch) -> None:
    """``qworker run -o http_port=...`` (or group_id, model, ...: any setting with a flag of its
    own). Before: a TypeError traceback (the same keyword passed twice), whatever the value."""
    from typer.testing import CliRunner

    from qworker.cli import app

    import logging

    for k in [k for k in os.environ if k.startswith("QWORKER_")]:
        monkeypatch.delenv(k)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        r = CliRunner().invoke(app, ["run", "-o", "http_port=abc", "-o", "group_id=g"])
        assert r.exit_code == 2, r.output
        assert "QWORKER_HTTP_PORT" in r.output and "TypeError" not in r.output, r.output
        r = CliRunner().invoke(app, ["run", "--model", "/nonexistent", "-o", "model=/also-not", "--http-port", "-1"])  # the flag wins
        assert r.exit_code == 2 and "'/nonexistent'" in r.output, r.output
    finally:  # qworker run installs its log handler on the root logger
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_tracing_misconfiguration_is_a_named_error() -> None:
    from qworker.telemetry.tracing import TracingConfigError, configure_tracing

    for env, name in [({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
                      ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "pigeon"}, "OTEL_EXPORTER_OTLP_PROTOCOL")]:
        with pytest.raises(TracingConfigError, match=name):
            configure_tracing(env, install_global=False)


# ------------------------------------------------------------------ a delivery retry names its job
async def test_a_delivery_retry_is_logged_with_its_job_id(tmp_path: Path, caplog) -> None:
    """Through a frozen broker: an answer's delivery times out and is retried. Before: the
    ``delivery to <topic> failed ... retrying`` lines (one per job per retry during an outage)
    named no job, so an operator could not tell whose answer was stuck."""
    import asyncio
    import logging
    import signal

    from qworker.broker import start_broker, stop_broker
    from qworker.worker.client import create_topics
    from qworker.worker.producer import start_producer
    from qworker.worker.publisher import Publisher

    from .conftest import make_settings

    broker = start_broker(log_dir=tmp_path)
    try:
        s = make_settings(broker.bootstrap, request_timeout_ms=1000)
        await create_topics(s, partitions=1)
        producer = await start_producer({**s.producer_options(), "request_timeout_ms": 1000, "compression_type": None})
        try:
            pub = Publisher(producer, lambda: False)
            await pub.deliver(s.completions_topic, "warm", b"{}")  # metadata known before the freeze
            os.kill(broker.proc.pid, signal.SIGSTOP)
            _wait_stopped(broker.proc.pid)  # every thread of it, before the delivery starts (a CI run raced it once)
            try:
                with caplog.at_level(logging.WARNING, logger="qworker.worker.publisher"):
                    task = asyncio.create_task(pub.deliver(s.completions_topic, "job-stuck", b"{}"))
                    loop = asyncio.get_running_loop()
                    deadline = loop.time() + 60
                    while not any(getattr(r, "job_id", None) == "job-stuck" for r in caplog.records):
                        assert not task.done() and loop.time() < deadline, [r.getMessage() for r in caplog.records]
                        await asyncio.sleep(0.05)
            finally:
                os.kill(broker.proc.pid, signal.SIGCONT)
            await asyncio.wait_for(task, 60)
        finally:
            await producer.stop()
    finally:
        stop_broker(broker)


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until every thread of ``pid`` is in the stopped state (``T`` in /proc/PID/task/*/stat)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()]
        if all(st in ("T", "t") for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (the SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def test_a_sigterm_while_the_worker_imports_is_a_clean_stop(tiny_model_dir: Path) -> None:
    """helper-50: a SIGTERM that landed while ``qworker run`` was still importing (torch takes
    seconds, before serve() installs the draining handler) ended it with 143, not the 0 of a
    clean stop; nothing is held then. Sent as soon as the command has its first handler (the
    first lines of qworker.cli), then a second one 20 ms later."""
    import signal

    p = subprocess.Popen([sys.executable, "-m", "qworker.cli", "run"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_clean_env(QWORKER_MODEL=str(tiny_model_dir), QWORKER_BOOTSTRAP_SERVERS="127.0.0.1:9", QWORKER_HTTP_PORT="-1"))
    try:
        deadline = time.monotonic() + 60
        while p.poll() is None and not _catches(p.pid, signal.SIGTERM) and time.monotonic() < deadline:
            time.sleep(0.002)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.02)
        if p.poll() is None:  # helper-53: a second one landed in the unwinding of an import (143, or 1)
            p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, (p.returncode, err.decode()[-2000:])


_SPAWNS_A_FOLLOWER = """
import multiprocessing as mp, os, signal, sys, time
from qworker.cli import app  # as the console script does; sys.argv is [.., "run"]


def follower():
    time.sleep(60)


if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=follower, daemon=True)
    p.start()
    time.sleep(5)  # its bootstrap re-imports this file, and qworker.cli with it
    os.kill(p.pid, signal.SIGTERM)
    p.join(30)
    print(p.exitcode)
"""


def test_a_spawned_follower_keeps_the_default_sigterm(tmp_path: Path) -> None:
    """helper-55: a tensor-parallel follower is spawned with the leader's argv and re-imports
    qworker.cli, so it took the pre-start handler too and a SIGTERM ended it with 0 (the leader
    then read a clean stop); it must die of the signal as before."""
    script = tmp_path / "leader.py"
    script.write_text(_SPAWNS_A_FOLLOWER)
    out = subprocess.run([sys.executable, str(script), "run"], cwd=REPO, env=_clean_env(), capture_output=True, timeout=180)
    assert out.stdout.decode().split()[-1:] == ["-15"], (out.stdout.decode(), out.stderr.decode()[-2000:])



_LOADS_FOR_AN_HOUR = """
import asyncio, sys, time
sys.argv = ["qworker", "run"]
import qworker.worker.app as app


async def load_for_an_hour(settings):
    # a large model's load: a thread that holds the GIL only now and then, which nothing interrupts
    print("LOADING", flush=True)
    await asyncio.to_thread(time.sleep, 3600)


app.load_engine = load_for_an_hour
from qworker.cli import app as cli

cli()
"""


def test_a_second_sigterm_while_the_model_loads_stops_at_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    """helper-71: a second SIGTERM during the model load logged "aborting now" and then waited
    for the load to end (seconds for the test model, minutes for a large one): the load runs in
    a thread nothing interrupts. Before the worker joins its group it holds nothing, so it now
    exits at once, status 0. The load of a large model is stood in for by an hour's sleep in
    the loading thread (the real command otherwise)."""
    import signal

    import urllib.error
    import urllib.request

    from qworker.broker import free_port

    def probe(path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", None, 5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    script = tmp_path / "run_worker.py"
    script.write_text(_LOADS_FOR_AN_HOUR)
    port = free_port()
    p = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_clean_env(QWORKER_MODEL=str(tiny_model_dir), QWORKER_LOG_LEVEL="INFO", QWORKER_HTTP_PORT=str(port),
                                        QWORKER_HTTP_HOST="127.0.0.1"))
    try:
        assert p.stdout is not None and p.stdout.readline() == b"LOADING\n", p.communicate()[1].decode()[-2000:]
        # while it loads the pod is alive but not started: the chart's startup probe waits on /startupz
        assert (probe("/healthz"), probe("/startupz")) == (200, 503)
        p.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert p.poll() is None, "the first SIGTERM waits for the load"
        p.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0 and took < 5, (p.returncode, took, err.decode()[-2000:])
    assert "stopping at once" in err.decode()
