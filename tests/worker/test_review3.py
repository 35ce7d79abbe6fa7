"""Regression tests for the third review's worker findings on intake, probes, logs, streams and
attempts. Each failed before its fix (the docstrings say how); through the real Tansu broker and
the tiny random-weight model, a few seconds each."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import signal
import urllib.error
import urllib.request

import pytest
from aiokafka import AIOKafkaProducer

from qworker.messages import DLQ_HEADER_ERROR, Job, Sampling, dumps
from qworker.worker.client import submit
from qworker.worker.decode import Invalid, Unparseable, decode
from qworker.worker.jobs import ATTEMPT_SPAN, Attempts

from .conftest import Results, stream_text, wait_committed
from .test_flow import engines, job, one_torch_thread, started  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(180)


async def _produce(s, key: bytes, value: bytes, headers: list | None = None) -> None:
    p = AIOKafkaProducer(bootstrap_servers=s.bootstrap_servers, enable_idempotence=False, max_request_size=4 << 20)
    await p.start()
    try:
        await p.send_and_wait(s.jobs_topic, value, key=key, headers=headers)
    finally:
        await p.stop()


# ------------------------------------------------------------------ valid JSON nested too deep
def _deep(prefix: bytes, depth: int) -> bytes:
    return prefix + b'"m": ' + b"[" * depth + b"]" * depth + b"}"


def test_deep_json_is_told_from_garbage() -> None:
    """Before: every record the decoders refused was ``not_json``, id or not."""
    d = decode(_deep(b'{"id": "deep-1", ', 5000))
    assert isinstance(d, Invalid) and d.job_id == "deep-1" and d.dead_letter == "too_deep" and d.code == "invalid_job"
    assert "5001 levels" in d.message
    o = decode(_deep(b'{"custom_id": "req-1", "id": 3, ', 3000))
    assert isinstance(o, Invalid) and o.job_id == "req-1" and o.wire is not None
    for raw, code in [
        (_deep(b'{"id": 7, ', 3000), "no_id"),  # no usable id: cannot be answered
        (b"[" * 3000 + b"]" * 3000, "not_object"),
        (_deep(b'{"id": "x", ', 3000)[:-1], "not_json"),  # unterminated: not JSON at any depth
        (b'{"id": "x", "m": ' + b"[" * 3000 + b"}" * 3000, "not_json"),
    ]:
        u = decode(raw)
        assert isinstance(u, Unparseable) and u.code == code, (raw[:40], u)


async def test_deep_json_with_an_id_is_answered(topics, results: Results, engines) -> None:
    """Before: dead-lettered as ``not_json`` and no completion, although the record had an id."""
    eng = await engines()
    w = await started(topics, eng)
    try:
        await _produce(topics, b"deep-1", _deep(b'{"id": "deep-1", "prompt": "hi", ', 4000))
        await _produce(topics, b"req-1", _deep(b'{"custom_id": "req-1", "method": "POST", "url": "/v1/completions", ', 4000))
        await results.wait(lambda: {"deep-1", "req-1"} <= set(results.completions) and len(results.dlq) == 2, 30, "both answered and copied")
        [native] = results.completions["deep-1"]
        assert native["type"] == "error" and native["error"]["code"] == "invalid_job" and "4001 levels" in native["error"]["message"]
        [line] = results.completions["req-1"]
        assert line["custom_id"] == "req-1" and line["error"]["code"] == "invalid_job"
        assert all(dict(r.headers)[DLQ_HEADER_ERROR] == b"too_deep" for r in results.dlq)
        await wait_committed(topics)
    finally:
        await w.stop()


# ------------------------------------------------------------------ /readyz follows the broker
async def _status(port: int) -> tuple[int, dict]:
    def get() -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", None, 5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    return await asyncio.to_thread(get)


async def _wait_status(port: int, want: int, timeout: float) -> dict:
    """Polls /readyz until it answers ``want``; the cap is generous (the settings make the real
    transition take a few seconds), so only a probe that never turns fails."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        code, body = await _status(port)
        if code == want:
            return body
        assert loop.time() < deadline, f"/readyz stayed {code} ({body}) for {timeout}s, expected {want}"
        await asyncio.sleep(0.2)


async def test_readyz_follows_a_frozen_broker(engines, tmp_path) -> None:
    """SIGSTOP the broker: /readyz turns 503 (in_group false), SIGCONT: 200 again. Before:
    ``in_group`` was a flag set at the first assignment, and /readyz stayed 200 with the broker
    frozen (80 s observed with the default timeouts; for as long as it stays frozen here)."""
    from qworker.broker import start_broker, stop_broker
    from qworker.worker.client import create_topics

    from .conftest import make_settings

    broker = start_broker(log_dir=tmp_path)
    try:
        s = make_settings(broker.bootstrap, http_port=0, http_host="127.0.0.1", ready_timeout_s=2.0)
        await create_topics(s, partitions=2)
        w = await started(s, await engines())
        try:
            port = w.http.port
            await _wait_status(port, 200, 30)
            os.kill(broker.proc.pid, signal.SIGSTOP)
            try:
                body = await _wait_status(port, 503, 60)
                assert body["checks"]["in_group"] is False and body["checks"]["model_loaded"] is True
            finally:
                os.kill(broker.proc.pid, signal.SIGCONT)
            await _wait_status(port, 200, 60)
        finally:
            await w.stop(drain_timeout_s=5)
    finally:
        stop_broker(broker)


# ------------------------------------------------------------------ hostile headers and ids in the logs
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
FORGED = "2026-01-01T00:00:00.000Z INFO qworker.jobs: FORGED"
_LINE_START = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ")


@pytest.fixture
def log_to():
    """``log_to(fmt)``: the process's logging as ``qworker run`` configures it, into a buffer;
    the root logger's handlers and level are restored afterwards."""
    from qworker.telemetry.logging import configure_logging

    root = logging.getLogger()
    saved = (list(root.handlers), root.level)

    def install(fmt: str) -> io.StringIO:
        buf = io.StringIO()
        configure_logging(fmt, "INFO", stream=buf)
        return buf

    yield install
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_hostile_header_and_id_cannot_forge_a_log_line(fmt: str, topics, results: Results, engines, log_to) -> None:
    """A ``tracestate`` with a newline and a NUL (OpenTelemetry logs the bad pair), and a job id
    with the same, pass through the worker. Before: the text log got the newline raw (a second,
    forged line) and the NUL byte, and ``job finished`` named no job and no trace."""
    eng = await engines()
    jid = f"forge\n{FORGED} job_id=x\x00"
    headers = [("traceparent", f"00-{TRACE_ID}-b7ad6b7169203331-01".encode()), ("tracestate", f"a=b\n{FORGED}\x00,c=\u2028".encode())]
    buf = log_to(fmt)
    w = await started(topics, eng)
    try:
        await _produce(topics, jid.encode(), dumps(job(jid, max_tokens=2)), headers)
        await results.wait(lambda: jid in results.completions, 30, "the job")
        await asyncio.sleep(0.2)  # the outcome line follows the delivery acknowledgement
    finally:
        await w.stop()
    text = buf.getvalue()
    assert "\x00" not in text and "\u2028" not in text
    lines = text.splitlines()
    assert any("FORGED" in ln for ln in lines), "the hostile values were logged (escaped)"
    if fmt == "text":
        for ln in lines:
            assert _LINE_START.match(ln) or ln.startswith("  | "), ln
            assert not ln.startswith(FORGED)
        [done] = [ln for ln in lines if " job finished " in ln and "forge" in ln]
        # the id has spaces, so it is quoted, and inside quotes the escapes' backslashes are doubled
        assert "job_id=" in done and "forge\\\\n2026-01-01" in done and f"trace_id={TRACE_ID}" in done and "\\x00" in done
    else:
        recs = [json.loads(ln) for ln in lines]  # each line one object
        assert not any(any(ord(c) < 32 for c in json.dumps(r, ensure_ascii=False).replace("\\n", "")) for r in recs)
        [done] = [r for r in recs if r["msg"] == "job finished" and "forge" in r.get("job_id", "")]
        assert done["job_id"] == jid.replace("\n", "\\n").replace("\x00", "\\x00") and done["trace_id"] == TRACE_ID


# ------------------------------------------------------------------ the stream's end marker
async def test_completion_names_the_last_seq_of_its_stream(topics, results: Results, engines) -> None:
    """Before: a native stream had no end marker; a reader could not tell it had every delta."""
    eng = await engines()
    w = await started(topics, eng)
    try:
        streamed = Job(id="ls-2", prompt="hello there", sampling=Sampling(max_tokens=12, temperature=0.0, ignore_eos=True, n=2), stream=True)
        await submit(topics, [streamed, job("ls-plain", max_tokens=3)])
        await results.wait(lambda: {"ls-2", "ls-plain"} <= set(results.completions), 30, "both jobs")
        [c] = results.completions["ls-2"]
        mine = [d for d in results.deltas["ls-2"] if d["run_id"] == c["run_id"]]
        assert c["last_seq"] == max(d["seq"] for d in mine) and sorted(d["seq"] for d in mine) == list(range(c["last_seq"] + 1))
        assert {d["index"] for d in mine} == {0, 1}  # one seq numbering across the choices
        for i in (0, 1):
            assert stream_text(mine, c["run_id"], i) == c["choices"][i]["text"]
        assert results.completions["ls-plain"][0]["last_seq"] is None
    finally:
        await w.stop()


# ------------------------------------------------------------------ attempts of a resubmitted id
def test_attempts_grow_per_answer_and_per_generation() -> None:
    a = Attempts(max_ids=2)
    first = [a.next("x", 3), a.next("x", 3), a.next("y", 3)]
    assert first == [3 * ATTEMPT_SPAN, 3 * ATTEMPT_SPAN + 1, 3 * ATTEMPT_SPAN]
    assert a.next("x", 4) == 4 * ATTEMPT_SPAN > first[1]  # a rerun after a rebalance beats any count
    a.next("z", 4)  # bounded: the least recently answered id ("y") is forgotten
    assert a.next("y", 4) == 4 * ATTEMPT_SPAN and len(a._last) == 2


async def test_resubmitted_job_gets_a_higher_attempt(topics, results: Results, engines) -> None:
    """Before: the same attempt (the group generation) for both answers, so a reader that
    deduplicates by (job id, attempt) dropped the second as a copy of the first."""
    eng = await engines()
    w = await started(topics, eng)
    try:
        await submit(topics, [job("again", max_tokens=2)])
        await results.wait(lambda: len(results.completions.get("again", [])) == 1, 30, "the first answer")
        await submit(topics, [job("again", max_tokens=3)])
        await results.wait(lambda: len(results.completions.get("again", [])) == 2, 30, "the second answer")
        first, second = results.completions["again"]
        assert second["attempt"] > first["attempt"] and second["run_id"] != first["run_id"]
        assert len(second["choices"][0]["token_ids"]) == 3
    finally:
        await w.stop()
