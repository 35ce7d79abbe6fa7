"""The batch-file commands' parts that need a broker but no model: which answer ``collect`` keeps,
the 504 lines of a timed-out wait, the idempotence fallback, and ``qworker broker``."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from qworker.broker import HOST, free_port
from qworker.messages import Choice, Completion, ErrorInfo, JobError, Timings, Usage, dumps
from qworker.openai_batch.files import read_lines
from qworker.openai_batch.requests import OpenAIRequest
from qworker.openai_batch.results import IdText, output_line, run_headers
from qworker.openai_batch.transfer import collect_lines
from qworker.worker.client import create_topics
from qworker.worker.producer import start_producer

from .conftest import REPO, make_settings
from .openai_support import validate_line

pytestmark = pytest.mark.timeout(90)


def completion(job_id: str, attempt: int, text: str) -> Completion:
    return Completion(job_id=job_id, attempt=attempt, run_id=f"run-{attempt}", model="m",
                      choices=[Choice(index=0, text=text, token_ids=[1], finish_reason="stop", logprobs=[{"1": -0.25}])],
                      usage=Usage(prompt_tokens=3, completion_tokens=1), timings=Timings(total_s=0.1))


async def test_collect_keeps_the_final_answer_converts_native_and_times_out(broker, tmp_path) -> None:
    s = make_settings(broker.bootstrap)
    await create_topics(s, partitions=2)
    line = lambda cid: orjson.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "q"}]}})
    batch = b"\n".join([line("a"), b"", line("a"), orjson.dumps({"id": "n1", "prompt": "p", "sampling": {"logprobs": 0}}), line("late"), line("old"), b"{oops"])
    (tmp_path / "b.jsonl").write_bytes(batch)
    lines = read_lines(batch)
    assert [ln.key for ln in lines] == ["a", "a", "n1", "late", "old", None]  # the blank line is no request
    since = time.time()
    p = AIOKafkaProducer(bootstrap_servers=s.bootstrap_servers, enable_idempotence=False)
    await p.start()
    try:
        ctx = OpenAIRequest("a", "chat", None)
        # a rerun's answer (attempt 3) lands before a stale attempt-1 copy: attempt 3 stands
        for attempt, text in ((3, "final"), (1, "stale")):
            msg = completion("a", attempt, text)
            await p.send_and_wait(s.completions_topic, orjson.dumps(output_line(msg, ctx, IdText())), key=b"a", headers=run_headers(attempt, msg.run_id))
        # native: a completion, then a later attempt's error, which wins
        await p.send_and_wait(s.completions_topic, dumps(completion("n1", 0, "native text")), key=b"n1")
        err = JobError(job_id="n1", attempt=2, run_id="r2", error=ErrorInfo(code="engine_error", message="boom", retryable=True))
        await p.send_and_wait(s.completions_topic, dumps(err), key=b"n1")
        # an answer from before --since (an earlier submission of the same id) does not count
        await p.send_and_wait(s.completions_topic, dumps(completion("old", 0, "x")), key=b"old", timestamp_ms=int((since - 60) * 1000))
    finally:
        await p.stop()
    rep, results = await collect_lines(s, lines, tmp_path / "out.jsonl", timeout_s=3.0, since_s=since)
    assert [orjson.loads(x) for x in (tmp_path / "out.jsonl").read_bytes().splitlines()] == results
    assert [r["custom_id"] for r in results] == ["a", "a", "n1", "late", "old", "line-7"]
    for r in results:
        validate_line(r)
    assert [r["response"]["body"]["choices"][0]["message"]["content"] for r in results[:2]] == ["final", "final"]
    assert (results[2]["response"]["status_code"], results[2]["error"]["code"]) == (503, "engine_error")
    assert [r["response"]["status_code"] for r in results[3:]] == [504, 504, 400]
    assert rep.timed_out and rep.not_answered == 2 and rep.ok == 2 and rep.errors == {"engine_error": 1, "not_answered": 2, "invalid_job": 1}


async def test_native_result_converted_by_the_line_form(broker) -> None:
    s = make_settings(broker.bootstrap)
    await create_topics(s, partitions=1)
    p = AIOKafkaProducer(bootstrap_servers=s.bootstrap_servers, enable_idempotence=False)
    await p.start()
    try:
        for jid in ("chat", "text"):
            await p.send_and_wait(s.completions_topic, dumps(completion(jid, 0, "hello")), key=jid.encode())
    finally:
        await p.stop()
    lines = read_lines(b'{"id": "chat", "messages": [{"role": "user", "content": "x"}], "sampling": {"logprobs": 0}}\n{"id": "text", "prompt": "x"}\n')
    rep, (chat, text) = await collect_lines(s, lines, None, timeout_s=20)
    assert not rep.timed_out and rep.ok == 2
    cc, tc = validate_line(chat), validate_line(text)
    assert cc.object == "chat.completion" and cc.choices[0].message.content == "hello"
    assert cc.choices[0].logprobs.content[0].token == "token_id:1" and cc.choices[0].logprobs.content[0].logprob == -0.25
    assert tc.object == "text_completion" and tc.choices[0].text == "hello" and tc.choices[0].logprobs is None
    assert cc.id == "chatcmpl-run-0" and chat["id"] == "batch_req_run-0"


async def test_producer_falls_back_when_idempotence_is_refused(broker, caplog) -> None:
    s = make_settings(broker.bootstrap, enable_idempotence=True)
    with caplog.at_level(logging.WARNING):
        p = await start_producer(s.producer_options())
    try:
        await p.send_and_wait("fallback-check", b"v", key=b"k")  # it works
    finally:
        await p.stop()
    [rec] = [r for r in caplog.records if r.levelno >= logging.WARNING]  # one line, aiokafka's own error held back
    assert rec.name == "qworker.producer" and "QWORKER_ENABLE_IDEMPOTENCE=false" in rec.getMessage()
    # nothing to fall back from: idempotence off raises nothing and warns nothing
    caplog.clear()
    p = await start_producer(make_settings(broker.bootstrap).producer_options())
    await p.stop()
    assert not [r for r in caplog.records if r.name == "qworker.producer"]


def test_broker_command_runs_prints_env_and_stops_cleanly(tmp_path) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "qworker.cli", "broker", "--port", str(port), "--partitions", "2"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")})
    try:
        seen = []
        deadline = time.monotonic() + 60
        while not any(ln.strip().startswith("export ") for ln in seen):
            assert time.monotonic() < deadline and proc.poll() is None, seen
            seen.append(proc.stdout.readline().decode())
        env_line = next(ln for ln in seen if ln.strip().startswith("export ")).split("export ", 1)[1].split()
        env = dict(kv.split("=", 1) for kv in env_line)
        assert env["QWORKER_BOOTSTRAP_SERVERS"] == f"{HOST}:{port}" and env["QWORKER_ENABLE_IDEMPOTENCE"] == "false"
        assert any("qworker.jobs" in ln for ln in seen)  # it created the topics
        with socket.create_connection((HOST, port), timeout=2):
            pass
        # the same port again: one line, exit 2
        again = subprocess.run([sys.executable, "-m", "qworker.cli", "broker", "--port", str(port)], cwd=REPO, capture_output=True, timeout=60)
        assert again.returncode == 2 and b"already in use" in again.stderr and len(again.stderr.strip().splitlines()) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with pytest.raises(OSError):
        socket.create_connection((HOST, port), timeout=1).close()  # the broker went with it
