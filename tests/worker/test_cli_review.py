"""Regression tests from an adversarial review of the client commands (submit, collect, tail,
topics create) and the result reader under them. Each failed before its fix."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from qworker.broker import free_port
from qworker.cli import app
from qworker.worker.client import ResultReader, create_topics

from .conftest import make_settings

pytestmark = pytest.mark.timeout(120)


def invoke(args: list[str], bootstrap: str, **env: str):
    env = {"QWORKER_BOOTSTRAP_SERVERS": bootstrap, "QWORKER_ENABLE_IDEMPOTENCE": "false", **env}
    return CliRunner().invoke(app, args, env=env)


def one_line_error(res, code: int, *needles: str) -> None:
    assert res.exit_code == code, (res.exit_code, res.output, res.exception)
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert "Traceback" not in res.output, res.output
    for needle in needles:
        assert needle in res.output, res.output


@pytest.mark.parametrize("args", [["tail", "--idle-timeout-s", "1"], ["topics", "create"]])
def test_commands_without_a_broker_say_so_in_one_line(args) -> None:
    """tail and topics create did not go through the one-line "cannot reach Kafka" (a 90-line
    traceback, exit 1)."""
    one_line_error(invoke(args, f"127.0.0.1:{free_port()}"), 2, "cannot reach Kafka")


@pytest.mark.parametrize("flag, value", [("--max-tokens", "0"), ("--temperature", "-1"), ("--priority", "3000000000")])
def test_submit_flags_out_of_range_are_usage_errors_naming_the_flag(flag, value) -> None:
    """A pydantic traceback, exit 1 (which submit documents as "the broker refused a line")."""
    one_line_error(invoke(["submit", "-p", "hi", flag, value], f"127.0.0.1:{free_port()}"), 2, flag)


def _batch(tmp_path: Path) -> Path:
    batch = tmp_path / "b.jsonl"
    batch.write_bytes(orjson.dumps({"custom_id": "never-sent", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}) + b"\n")
    return batch


def test_collect_refuses_an_out_it_could_not_write_in_the_end(broker, tmp_path) -> None:
    """The pre-check looked at the folder's permission bits only: a folder in the way of the
    temporary name (or /proc, or any path root passes os.access for) failed after the whole wait."""
    out = tmp_path / "o.jsonl"
    (tmp_path / "o.jsonl.tmp").mkdir()
    s = make_settings(broker.bootstrap)
    res = invoke(["collect", "--ids-from", str(_batch(tmp_path)), "--out", str(out), "--timeout", "600"], broker.bootstrap,
                 QWORKER_COMPLETIONS_TOPIC=s.completions_topic)
    one_line_error(res, 2, "o.jsonl.tmp")


def test_collect_keeps_the_answers_when_the_final_write_fails(broker, tmp_path, monkeypatch) -> None:
    """Something in the way only after the wait (here the check is skipped): the lines go to a
    temporary file the command names, not lost with a traceback."""
    s = make_settings(broker.bootstrap)
    asyncio.run(create_topics(s, partitions=1))
    out = tmp_path / "o.jsonl"
    (tmp_path / "o.jsonl.tmp").mkdir()
    monkeypatch.setattr("qworker.openai_batch.transfer.unwritable", lambda out: None)
    res = invoke(["collect", "--ids-from", str(_batch(tmp_path)), "--out", str(out), "--timeout", "2"], broker.bootstrap,
                 QWORKER_COMPLETIONS_TOPIC=s.completions_topic)
    one_line_error(res, 2, f"cannot write {out}")
    spare = Path(re.search(r"output lines are in (\S+)", res.output).group(1))
    try:
        [line] = [orjson.loads(x) for x in spare.read_bytes().splitlines()]
        assert line["custom_id"] == "never-sent" and line["error"]["code"] == "not_answered"
    finally:
        spare.unlink()


def test_submit_follow_that_times_out_says_so_and_exits_3(broker) -> None:
    """It exited 0 with nothing printed: a script could not tell a timeout from success."""
    s = make_settings(broker.bootstrap)
    asyncio.run(create_topics(s, partitions=1))
    topics = {f"QWORKER_{k.upper()}": getattr(s, k) for k in ("jobs_topic", "tokens_topic", "completions_topic")}
    res = invoke(["submit", "-p", "hi", "--id", "nobody-answers", "--follow", "--timeout-s", "2"], broker.bootstrap, **topics)
    one_line_error(res, 3, "gave up", "nobody-answers")


class _Closing:
    """A consumer whose close fails as aiokafka's did with its broker gone (its fetch task's
    CancelledError escaping ``stop()``; a race, seen in about half the runs), or hangs."""

    def __init__(self, how: str) -> None:
        self.how = how

    async def stop(self) -> None:
        if self.how == "cancelled":
            raise asyncio.CancelledError()
        if self.how == "error":
            raise ConnectionError("gone")
        await asyncio.sleep(3600)


@pytest.mark.parametrize("how", ["cancelled", "error", "hangs"])
async def test_result_reader_stop_survives_a_close_that_fails(broker, how, monkeypatch) -> None:
    """collect and submit --follow died with a CancelledError traceback (exit 1) before writing
    what they had read, when the broker had gone away during the wait."""
    monkeypatch.setattr("qworker.client.STOP_TIMEOUT_S", 0.5)
    reader = ResultReader(make_settings(broker.bootstrap))
    reader.consumer = _Closing(how)
    await asyncio.wait_for(reader.stop(), 5)  # neither raises nor hangs


async def test_result_reader_stop_still_lets_its_caller_be_cancelled(broker, monkeypatch) -> None:
    """Ctrl-C (the caller's task cancelled) during the close still stops the command."""
    reader = ResultReader(make_settings(broker.bootstrap))
    reader.consumer = _Closing("hangs")
    task = asyncio.create_task(reader.stop())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_submit_follow_without_result_topics_is_one_line(broker) -> None:
    """A fresh broker without the result topics: an 80-line TimeoutError traceback, exit 1, after
    20 s whatever --timeout-s said."""
    res = invoke(["submit", "-p", "hi", "--follow", "--timeout-s", "2"], broker.bootstrap,
                 QWORKER_TOKENS_TOPIC="absent-tokens", QWORKER_COMPLETIONS_TOPIC="absent-completions")
    one_line_error(res, 2, "not found", "topics create")


def test_collect_writes_through_links_and_pipes_instead_of_replacing_them(tmp_path) -> None:
    """--out naming a symlink, a FIFO or a device (/dev/stdout, /dev/null) was replaced by a
    regular file (the temporary file renamed over it): as root, -o /dev/null clobbered the node."""
    import os
    import threading

    from qworker.openai_batch.transfer import unwritable, write_lines

    target = tmp_path / "target.jsonl"
    target.write_text("old\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert unwritable(link) is None
    write_lines(link, [{"a": 1}])
    assert link.is_symlink() and target.read_bytes() == b'{"a":1}\n'
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert unwritable(pipe) is None
    got = []
    reader = threading.Thread(target=lambda: got.append(pipe.read_bytes()))
    reader.start()
    write_lines(pipe, [{"b": 2}])
    reader.join(10)
    assert got == [b'{"b":2}\n'] and not pipe.is_file()


def test_collect_writes_to_the_shells_own_stdout_pipe_append_and_fd(tmp_path) -> None:
    """helper-118: ``--out /dev/stdout`` went through the link to ``/proc/<pid>/fd/pipe:[N]`` (no
    such file: exit 2, nothing written) or, after ``>> file``, to that file's path, which a new
    file was renamed over (what the file held before was lost). ``/dev/fd/N`` (``>(...)``) the
    same. Now such a name is written to the descriptor the shell opened."""
    import os
    import subprocess
    import sys

    child = ("import sys; from pathlib import Path; from qworker.openai_batch.transfer import unwritable, write_lines\n"
             "out = Path(sys.argv[1]); why = unwritable(out)\n"
             "assert why is None, why\n"
             "write_lines(out, [{'a': 1}])")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def run(out: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", child, out], env=env, timeout=60, **kw)

    piped = run("/dev/stdout", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert piped.returncode == 0 and piped.stdout == b'{"a":1}\n', piped.stderr.decode()[-2000:]
    kept = tmp_path / "app.txt"
    kept.write_bytes(b"PREVIOUS\n")
    with open(kept, "ab") as f:  # the shell's >>
        appended = run("/dev/stdout", stdout=f, stderr=subprocess.PIPE)
    assert appended.returncode == 0, appended.stderr.decode()[-2000:]
    assert kept.read_bytes() == b'PREVIOUS\n{"a":1}\n'
    r, w = os.pipe()  # the shell's >(...): a pipe on a descriptor of its own
    try:
        via_fd = run(f"/dev/fd/{w}", pass_fds=(w,), stderr=subprocess.PIPE)
        os.close(w)
        assert via_fd.returncode == 0, via_fd.stderr.decode()[-2000:]
        assert os.read(r, 100) == b'{"a":1}\n'
    finally:
        os.close(r)
    refused = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                              "from qworker.openai_batch.transfer import unwritable; print(unwritable(Path('/dev/stdin')))"],
                             env=env, input=b"", capture_output=True, timeout=60)  # stdin: a pipe's read end
    assert b"not open for writing" in refused.stdout, refused.stdout + refused.stderr


def test_tail_keeps_every_value_of_a_repeated_header_key(broker) -> None:
    """tail printed headers as a JSON object: of a key given twice (a DLQ record's headers echo the
    job's own), only the last value showed."""
    from aiokafka import AIOKafkaProducer

    s = make_settings(broker.bootstrap)
    asyncio.run(create_topics(s, partitions=1))

    async def produce() -> None:
        p = AIOKafkaProducer(bootstrap_servers=broker.bootstrap)
        await p.start()
        try:
            await p.send_and_wait(s.dlq_topic, b"{}", headers=[("trace", b"a"), ("trace", b"b"), ("other", b"c")])
        finally:
            await p.stop()

    asyncio.run(produce())
    res = invoke(["tail", "--from-beginning", "--topic", s.dlq_topic, "--idle-timeout-s", "3"], broker.bootstrap)
    assert res.exit_code == 0, (res.output, res.exception)
    [line] = [orjson.loads(x) for x in res.output.splitlines() if x.startswith("{")]
    assert line["headers"] == [["trace", "a"], ["trace", "b"], ["other", "c"]]


# helper-85 (2026-12-07): flags and settings that got past their checks


@pytest.mark.parametrize("args,needle", [
    (["topics", "create", "--partitions", "0"], "--partitions"),
    (["topics", "create", "--replication", "0"], "--replication"),
    (["broker", "--partitions", "0"], "--partitions"),
    (["collect", "--ids-from", "/dev/null", "--out", "/dev/null", "--timeout-s", "nan"], "--timeout-s"),
    (["collect", "--ids-from", "/dev/null", "--out", "/dev/null", "--since", "nan"], "--since"),
    (["submit", "-p", "x", "--follow", "--timeout-s", "-1"], "--timeout-s"),
    (["tail", "--idle-timeout-s", "-1"], "--idle-timeout-s"),
    (["submit", "-p", "x", "--id", ""], "--id"),
])
def test_flags_out_of_range_are_refused_before_any_broker_is_asked(args, needle) -> None:
    """A topic of 0 partitions was created (and `submit` then died in a modulo by zero), a NaN
    timeout made `collect` wait forever, a negative one gave up at once, an empty --id became a
    random one. Now usage errors naming the flag (no broker runs here: none is reached first)."""
    one_line_error(invoke(args, f"127.0.0.1:{free_port()}"), 2, needle)


@pytest.mark.parametrize("env,needle", [
    ({"QWORKER_SESSION_TIMEOUT_MS": "99999999999"}, "QWORKER_SESSION_TIMEOUT_MS"),
    ({"QWORKER_KAFKA_SECURITY_PROTOCOL": "SSL", "QWORKER_KAFKA_SSL_CAFILE": "{junk}"}, "QWORKER_KAFKA_SSL_CAFILE"),
])
@pytest.mark.parametrize("command", [["submit", "-p", "x"], ["tail", "--idle-timeout-s", "1"]])
def test_settings_that_fail_inside_the_kafka_client_are_one_line_for_every_command(env, needle, command, tmp_path) -> None:
    """A session timeout past int32 and a CA file that is not a certificate passed the settings'
    checks and failed inside aiokafka as tracebacks (`run` after loading the model); and every
    command but `run` printed a settings error as a traceback."""
    junk = tmp_path / "junk.pem"
    junk.write_text("junk\n")
    env = {k: v.format(junk=junk) for k, v in env.items()}
    one_line_error(invoke(command, f"127.0.0.1:{free_port()}", **env), 2, needle)


def test_an_empty_file_says_nothing_was_submitted(tmp_path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    res = invoke(["submit", "-f", str(empty)], f"127.0.0.1:{free_port()}")
    assert res.exit_code == 0 and "holds no lines; nothing submitted" in res.output, res.output


def test_tail_help_keeps_its_brackets() -> None:
    """Typer's markup swallowed "[key, value]" in `tail --help`."""
    res = CliRunner().invoke(app, ["tail", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "[key, value] pairs" in res.output, res.output
