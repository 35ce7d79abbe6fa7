"""Regression tests from an adversarial review of the OpenAI batch support (issue 15)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from qworker.broker import free_port
from qworker.openai_batch.files import read_lines
from qworker.openai_batch.requests import OpenAIRequest
from qworker.openai_batch.results import IdText, output_line, run_headers
from qworker.openai_batch.transfer import collect_lines
from qworker.worker.client import create_topics

from .conftest import REPO, make_settings
from .openai_support import validate_line
from .test_openai_cli import completion

pytestmark = pytest.mark.timeout(90)


async def test_collect_finishes_on_a_busy_completions_topic(broker) -> None:
    """Every id answered: collect must stop once it has read what was on the topic then, even
    while other jobs' answers keep arriving (a shared topic is never idle)."""
    s = make_settings(broker.bootstrap)
    await create_topics(s, partitions=2)
    p = AIOKafkaProducer(bootstrap_servers=s.bootstrap_servers, enable_idempotence=False, linger_ms=0)
    await p.start()
    stop = asyncio.Event()

    async def chatter() -> None:  # other clients' results, on and on
        i = 0
        while not stop.is_set():
            await p.send_and_wait(s.completions_topic, b"{}", key=f"other-{i}".encode())
            i += 1
            await asyncio.sleep(0.02)

    try:
        msg = completion("a", 0, "hi")
        ctx = OpenAIRequest("a", "chat")
        await p.send_and_wait(s.completions_topic, orjson.dumps(output_line(msg, ctx, IdText())), key=b"a", headers=run_headers(0, msg.run_id))
        task = asyncio.create_task(chatter())
        await asyncio.sleep(0.3)
        lines = read_lines(orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "q"}]}}))
        t0 = time.monotonic()
        rep, [line] = await collect_lines(s, lines, None, timeout_s=120.0)
        took = time.monotonic() - t0
        stop.set()
        await task
    finally:
        stop.set()
        await p.stop()
    assert not rep.timed_out and rep.ok == 1
    validate_line(line)
    # far below its timeout (the defect waited all of it), with room for any machine's speed
    assert took < 60.0, f"collect took {took:.1f} s with every id answered"


async def test_submit_follow_prints_the_answer_on_a_busy_tokens_topic(broker, capsys) -> None:
    """--follow holds an answer until the stream's tail is read; on a tokens topic other jobs
    keep writing to, it must still print it (it printed nothing until its timeout)."""
    from qworker.cli import _follow
    from qworker.messages import Delta, dumps
    from qworker.worker.client import ResultReader

    s = make_settings(broker.bootstrap)
    await create_topics(s, partitions=2)
    reader = ResultReader(s, [s.tokens_topic, s.completions_topic], from_beginning=True)
    await reader.start()
    p = AIOKafkaProducer(bootstrap_servers=s.bootstrap_servers, enable_idempotence=False, linger_ms=0)
    await p.start()
    stop = asyncio.Event()

    async def chatter() -> None:
        i = 0
        while not stop.is_set():
            await p.send_and_wait(s.tokens_topic, b"{}", key=f"other-{i}".encode())
            i += 1
            await asyncio.sleep(0.02)

    task = asyncio.create_task(chatter())
    try:
        await p.send_and_wait(s.tokens_topic, dumps(Delta(job_id="x", attempt=0, run_id="r", index=0, seq=0, text="hello", token_ids=[1])), key=b"x")
        await p.send_and_wait(s.completions_topic, dumps(completion("x", 0, "hello")), key=b"x")
        t0 = time.monotonic()
        await _follow(reader, ["x"], 120.0)
        took = time.monotonic() - t0
    finally:
        stop.set()
        await task
        await p.stop()
        await reader.stop()
    out = capsys.readouterr().out
    assert out.startswith("hello") and '"job_id":"x"' in out, out
    assert took < 60.0, f"--follow took {took:.1f} s"  # far below its timeout (the defect waited all of it)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_broker_command_stopped_while_starting_takes_the_broker_with_it(tmp_path, signum) -> None:
    """A signal while Tansu is still starting (before it listens) must stop it too, not leave
    it running orphaned on the port (SIGTERM killed qworker outright; SIGINT sent to the pid
    alone was a traceback)."""
    pidfile = tmp_path / "tansu.pid"
    fake = tmp_path / "tansu"
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}\nexec sleep 60\n")  # never listens
    fake.chmod(0o755)
    code = (f"import qworker.broker as b; b.tansu_bin = lambda: {str(fake)!r}\n"
            f"from qworker.cli import app; app(['broker', '--port', '{free_port()}', '--no-topics'])")
    log = tmp_path / "stderr"
    with open(log, "wb") as f:  # not pipes: the broker inherits them and would hold them open
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL, stderr=f)
    child = None
    try:
        deadline = time.monotonic() + 30
        while not pidfile.exists():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.02)
        child = int(pidfile.read_text())
        time.sleep(0.2)  # qworker is waiting for the port now
        proc.send_signal(signum)
        proc.wait(20)
        err = log.read_text()
        assert proc.returncode == 0 and "Traceback" not in err, err
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the broker process outlived qworker broker"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("role", [["user"], {"r": 1}])
def test_a_message_role_of_the_wrong_type_is_refused_by_name(role) -> None:
    from qworker.worker.decode import Invalid, decode

    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": role, "content": "x"}]}}
    d = decode(orjson.dumps(line))
    assert isinstance(d, Invalid) and d.param == "body.messages[0].role" and d.code == "invalid_job", d


def test_a_line_too_large_to_submit_is_answered_at_once_with_a_413() -> None:
    """The submitting producer refuses a record over its limit; collect had no way to know and
    waited out its whole timeout for the line (504). Both now agree it is not submitted."""
    from qworker.openai_batch.files import local_answer
    from qworker.worker.client import MAX_JOB_RECORD_BYTES

    big = orjson.dumps({"custom_id": "big", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x" * MAX_JOB_RECORD_BYTES}})
    ok = orjson.dumps({"custom_id": "ok", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x" * (MAX_JOB_RECORD_BYTES // 2)}})
    big_line, ok_line = read_lines(big + b"\n" + ok)
    assert ok_line.key == "ok"
    assert big_line.key is None and "bytes" in big_line.problem
    answer = local_answer(big_line)
    validate_line(answer)
    assert answer["custom_id"] == "big" and answer["response"]["status_code"] == 413 and answer["error"]["code"] == "request_too_large"


def test_collect_refuses_an_unwritable_out_before_waiting(broker, tmp_path) -> None:
    """--out in a folder that does not exist: one line and exit 2 at once, not a traceback after
    the whole wait (with every answer collected lost)."""
    from typer.testing import CliRunner

    from qworker.cli import app

    batch = tmp_path / "b.jsonl"
    batch.write_bytes(orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}) + b"\n")
    s = make_settings(broker.bootstrap)
    env = {"QWORKER_BOOTSTRAP_SERVERS": broker.bootstrap, "QWORKER_ENABLE_IDEMPOTENCE": "false", "QWORKER_COMPLETIONS_TOPIC": s.completions_topic}
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["collect", "--ids-from", str(batch), "--out", str(tmp_path / "missing" / "out.jsonl"), "--timeout", "600"], env=env)
    assert res.exit_code == 2 and (res.exception is None or isinstance(res.exception, SystemExit)), res.exception
    assert "missing" in res.output and "Traceback" not in res.output, res.output
    assert time.monotonic() - t0 < 300.0  # not after the whole 600 s wait


def test_broker_command_that_cannot_create_topics_stops_the_broker(tmp_path) -> None:
    """Tansu up but creating the topics fails: one line and a non-zero exit, and the broker
    stopped with it (it was a traceback that left Tansu running on the port)."""
    port = free_port()
    pidfile = tmp_path / "tansu.pid"
    fake = tmp_path / "tansu"
    server = ("import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              f"s.bind(('127.0.0.1', {port}))\ns.listen()\nwhile True:\n    s.accept()[0].close()\n")
    (tmp_path / "server.py").write_text(server)  # listens, but speaks no Kafka
    fake.write_text(f"#!/bin/sh\necho $$ > {pidfile}\nexec {sys.executable} {tmp_path / 'server.py'}\n")
    fake.chmod(0o755)
    code = (f"import qworker.broker as b; b.tansu_bin = lambda: {str(fake)!r}\n"
            f"from qworker.cli import app; app(['broker', '--port', '{port}'])")
    log = tmp_path / "stderr"
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")}
    env["QWORKER_REQUEST_TIMEOUT_MS"] = "2000"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.DEVNULL, stderr=f, env=env)
    child = None
    try:
        proc.wait(40)
        err = log.read_text()
        child = int(pidfile.read_text())
        assert proc.returncode not in (0, None) and "Traceback" not in err, err
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the broker process outlived qworker broker"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if child is not None and _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize("line", [
    {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "k" * 300_000: 1}},  # the name of a field
    {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}, "k" * 300_000: 1},
    {"custom_id": "a", "method": "P" * 300_000, "url": "/v1/completions", "body": {"prompt": "x"}},  # a value echoed
    {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x", "k" * 300_000: 1}]}},
    {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": list(range(100_000))}},
])
def test_an_error_line_stays_small_whatever_the_line_names(line) -> None:
    """The error names the field (and sometimes echoes its value): both came unbounded from the
    line, so a long field name made an error line no shortening could fit under the size limit
    (the answer was refused and the line never answered)."""
    from qworker.messages import JobError, json_bytes
    from qworker.openai_batch.results import output_line
    from qworker.worker.decode import Invalid, decode

    d = decode(orjson.dumps(line))
    assert isinstance(d, Invalid)
    err = JobError.model_validate({"job_id": "a", "attempt": 0, "run_id": "r", "error": {"code": d.code, "message": d.message, "retryable": False}})
    out = output_line(err, d.wire, IdText(), d.param)
    validate_line(out)
    assert len(json_bytes(out)) < 8192


@pytest.mark.parametrize("port", ["0", "70000", "-1"])
def test_broker_command_refuses_a_port_out_of_range(port) -> None:
    from typer.testing import CliRunner

    from qworker.cli import app

    res = CliRunner().invoke(app, ["broker", "--port", port])
    assert res.exit_code == 2 and (res.exception is None or isinstance(res.exception, SystemExit)), res.exception


def test_collect_converts_a_native_answer_for_a_line_with_an_odd_url() -> None:
    """A native result keyed like an OpenAI line whose url is not a string (say, an older native
    job with that id): collect crashed with 'unhashable type' after the whole wait."""
    from qworker.messages import dumps
    from qworker.openai_batch.files import to_output

    [ln] = read_lines(orjson.dumps({"custom_id": "a", "method": "POST", "url": ["/v1/completions"], "body": {}}))
    out = to_output(ln, orjson.loads(dumps(completion("a", 0, "hi"))))
    assert validate_line(out).choices[0].message.content == "hi"


def test_attempt_of_a_null_or_odd_attempt_header_is_zero() -> None:
    from qworker.openai_batch.files import attempt_of

    assert attempt_of({}, {"qworker.attempt": None}) == 0  # Kafka header values may be null
    assert attempt_of({}, {"qworker.attempt": b"x"}) == 0
    assert attempt_of({}, {"qworker.attempt": b"4"}) == 4


def test_a_deeply_nested_record_is_no_answer_not_a_crash() -> None:
    """A record under a line's key nested deeper than the parser recurses: collect and
    --follow ended with RecursionError."""
    from qworker.openai_batch.transfer import _parse
    from qworker.worker.client import parse

    assert _parse(b"[" * 100_000) is None and parse(b"[" * 100_000) is None


async def test_collect_stops_its_consumer_when_the_topic_never_appears(broker, monkeypatch) -> None:
    """No completions topic before the timeout: every line a 504, and the reader's consumer
    stopped (it was left open: 'Unclosed AIOKafkaConsumer' on exit)."""
    from qworker.worker.client import ResultReader

    stopped = []
    orig = ResultReader.stop

    async def stop(self) -> None:
        stopped.append(self)
        await orig(self)

    monkeypatch.setattr(ResultReader, "stop", stop)
    s = make_settings(broker.bootstrap)  # its topics were never created
    lines = read_lines(orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}))
    rep, [line] = await collect_lines(s, lines, None, timeout_s=1.0)
    assert rep.timed_out and line["response"]["status_code"] == 504
    assert len(stopped) == 1


@pytest.mark.parametrize(("endpoint", "code", "param"), [
    ("chat", "invalid_structured_output", "body.response_format"),
    ("completions", "invalid_structured_output", "body.response_format"),
    ("chat", "prompt_too_long", "body.messages"),
    ("completions", "prompt_too_long", "body.prompt"),
    ("chat", "invalid_prompt", "body.messages"),
    ("chat", "engine_error", None),
    ("completions", "deadline_exceeded", None),
])
def test_a_refusal_after_mapping_names_its_field(endpoint, code, param) -> None:
    """The engine's and the worker's own refusals (made after the line was mapped, so without the
    line checks' ``param``) said ``param: null`` even where the code points at one field."""
    from qworker.messages import JobError
    from qworker.openai_batch.requests import OpenAIRequest
    from qworker.openai_batch.results import output_line

    err = JobError.model_validate({"job_id": "a", "attempt": 0, "run_id": "r", "error": {"code": code, "message": "m", "retryable": False}})
    out = output_line(err, OpenAIRequest("a", endpoint), IdText())
    validate_line(out)
    assert out["response"]["body"]["error"]["param"] == param
    assert output_line(err, OpenAIRequest("a", endpoint), IdText(), "body.stop")["response"]["body"]["error"]["param"] == "body.stop"


async def test_submit_gives_up_on_a_broker_gone_mid_file(tmp_path, monkeypatch) -> None:
    """helper-118: with the broker killed mid-submit, each line waited out the producer's own
    timeouts one after another (~70 lines per 33 s: hours for a large file, no summary). Now a
    submit that neither sends nor has acknowledged a line for ``stall_limit_s`` reports the rest
    refused and returns."""
    from qworker.broker import Broker
    from qworker.openai_batch import transfer

    broker = Broker(log=tmp_path / "broker.log").start()
    try:
        s = make_settings(broker.bootstrap, request_timeout_ms=1000)
        await create_topics(s, partitions=1)
        monkeypatch.setattr(transfer, "stall_limit_s", lambda settings: 3.0)
        started = transfer.producer_for

        async def then_the_broker_dies(settings):
            p = await started(settings)
            broker.proc.kill()  # SIGKILL, by its pid
            broker.proc.wait(10)
            return p

        monkeypatch.setattr(transfer, "producer_for", then_the_broker_dies)
        # 4 KB lines: a few fill a batch, and each send then waits for a batch to drain
        body = b"".join(b'{"custom_id": "gone-%d", "method": "POST", "url": "/v1/completions", "body": {"prompt": "%s", "max_tokens": 2}}\n'
                        % (i, b"x" * 4000) for i in range(300))
        lines = read_lines(body)
        t0 = time.monotonic()
        rep = await asyncio.wait_for(transfer.submit_lines(s, lines), 60)
        assert time.monotonic() - t0 < 30
        assert rep.submitted == 0 and len(rep.refused) == 300
        assert all("acknowledged nothing" in why or "Error" in why for _, why in rep.refused), rep.refused[:3]
        assert [ln.number for ln, _ in rep.refused] == sorted(ln.number for ln in lines)
    finally:
        broker.stop()
