"""qworker: run the worker, submit jobs, tail results, create topics, fetch the model."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys


def _stop_before_start(signum: int, frame: object) -> None:
    """``qworker run`` before serve() installs its draining handler (after the imports: torch alone
    takes seconds): nothing is joined, consumed or written yet, so a SIGTERM or SIGINT is a clean
    stop, status 0 (the default action ended it with 143). At once, so that a second signal cannot
    land in the unwinding of an import."""
    os._exit(0)


# the worker's own process, before any import below; not a tensor-parallel follower, which a
# multiprocessing spawn starts with the leader's argv and this module imported again
if sys.argv[1:2] == ["run"] and multiprocessing.current_process().name == "MainProcess":
    for _signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(_signum, _stop_before_start)

import asyncio  # noqa: E402 - after the handler above
import logging  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import typer  # noqa: E402

from qworker.config import WorkerSettings  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
topics_app = typer.Typer(no_args_is_help=True, help="Manage qworker's topics.")
app.add_typer(topics_app, name="topics")


def _seconds(value: float | None) -> float | None:
    """A duration flag: a finite number of seconds above 0 (a NaN deadline never passed, a negative
    one had passed before the wait began)."""
    import math

    if value is not None and not (math.isfinite(value) and value > 0):
        raise typer.BadParameter(f"must be a finite number of seconds above 0, got {value}")
    return value


def _unix_time(value: float) -> float:
    import math

    if not (math.isfinite(value) and value >= 0):
        raise typer.BadParameter(f"must be a Unix time (a finite number >= 0), got {value}")
    return value


def _parse_options(options: list[str]) -> dict[str, str]:
    out = {}
    for o in options:
        if "=" not in o:
            raise typer.BadParameter(f"expected KEY=VALUE, got {o!r}")
        k, v = o.split("=", 1)
        out[k.strip().lower().replace("-", "_")] = v
    return out


def _settings(bootstrap_servers: str | None = None, **kw: object) -> WorkerSettings:
    """The settings from the environment and flags; a misconfiguration is one line naming the
    variable and exit status 2 (for every command, not only ``run``)."""
    from pydantic import ValidationError

    try:
        return WorkerSettings.from_env(bootstrap_servers=bootstrap_servers, **kw)
    except ValidationError as e:
        typer.echo(f"qworker: {WorkerSettings.explain(e)}", err=True)
        raise typer.Exit(2) from None


@app.command()
def run(
    bootstrap_servers: Optional[str] = typer.Option(None, help="Kafka bootstrap servers [QWORKER_BOOTSTRAP_SERVERS]"),
    model: Optional[str] = typer.Option(None, help="Model directory [QWORKER_MODEL]"),
    group_id: Optional[str] = typer.Option(None, help="Consumer group [QWORKER_GROUP_ID]"),
    http_port: Optional[int] = typer.Option(None, help="Probe/metrics port, 0 = any free port, -1 to disable [QWORKER_HTTP_PORT]"),
    drain_timeout_s: Optional[float] = typer.Option(None, help="SIGTERM drain budget [QWORKER_DRAIN_TIMEOUT_S]"),
    max_waiting_jobs: Optional[int] = typer.Option(None, help="Queued-job bound before pausing [QWORKER_MAX_WAITING_JOBS]"),
    kv_cache_memory: Optional[str] = typer.Option(None, help="KV cache size, e.g. 512MiB [QWORKER_KV_CACHE_MEMORY]"),
    max_num_seqs: Optional[int] = typer.Option(None, help="Max running sequences [QWORKER_MAX_NUM_SEQS]"),
    device: Optional[str] = typer.Option(None, help="cpu / cuda [QWORKER_DEVICE]"),
    dtype: Optional[str] = typer.Option(None, help="float32 / bfloat16 / float16 [QWORKER_DTYPE]"),
    lora_modules: list[str] = typer.Option([], "--lora-modules", help="LoRA adapters as vLLM's name=path (repeatable), JSON, or a file re-read live [QWORKER_LORA_MODULES]"),
    option: list[str] = typer.Option([], "--option", "-o", help="Any other setting as KEY=VALUE (e.g. -o session_timeout_ms=6000)"),
) -> None:
    """Run the worker until SIGTERM (which drains, commits and exits 0)."""
    flags = dict(bootstrap_servers=bootstrap_servers, model=model, group_id=group_id, http_port=http_port, drain_timeout_s=drain_timeout_s,
                 max_waiting_jobs=max_waiting_jobs, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs, device=device, dtype=dtype,
                 lora_modules=" ".join(lora_modules) or None)
    # a setting given both as its own flag and as -o KEY=VALUE: the flag wins (it was a
    # TypeError traceback: the same keyword twice)
    settings_kw = {**_parse_options(option), **{k: v for k, v in flags.items() if v is not None}}
    settings = _settings(**settings_kw)
    try:  # the environment's other switches, before a model loads (they are read deep inside it)
        from kernels.env import check_switches
        from qworker.model.parallel.comm import timeout_s as tp_timeout_s

        check_switches()
        tp_timeout_s()
    except ValueError as e:
        typer.echo(f"qworker: {e}", err=True)
        raise typer.Exit(2) from None
    from qworker.telemetry.logging import configure_logging

    configure_logging(settings.log_format, settings.log_level.upper())  # escapes control characters in every line
    logging.getLogger("aiokafka").setLevel(max(logging.WARNING, logging.getLogger().level))
    from qworker.worker import serve
    from qworker.worker.app import StartupError

    try:
        code = asyncio.run(serve(settings))
    except StartupError as e:  # a misconfiguration: one line, no traceback
        typer.echo(f"qworker: {e}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def submit(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text"),
    chat: Optional[str] = typer.Option(None, help="A user message (rendered with the chat template)"),
    system: Optional[str] = typer.Option(None, help="System message for --chat"),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="JSONL file, one native job or OpenAI batch request line per line ('-' for stdin)"),
    job_id: Optional[str] = typer.Option(None, "--id", help="Job id (default: random)"),
    max_tokens: int = typer.Option(32, help="max_tokens"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    priority: int = typer.Option(0, help="Lower runs first"),
    lora: Optional[str] = typer.Option(None, help="Run under this LoRA adapter (a name the worker's QWORKER_LORA_MODULES gives)"),
    stream: bool = typer.Option(True, help="Stream tokens to the tokens topic"),
    follow: bool = typer.Option(False, "--follow", help="Print the streamed result until every job finished"),
    timeout_s: float = typer.Option(300.0, help="--follow gives up after this long", callback=_seconds),
    bootstrap_servers: Optional[str] = typer.Option(None, help="[QWORKER_BOOTSTRAP_SERVERS]"),
) -> None:
    """Produce jobs from flags or a JSONL file (native jobs and OpenAI batch lines may mix).

    A file's lines go out as written, keyed by their id (custom_id or id), invalid ones too: the worker answers those with error lines. Lines without a usable id (not JSON, not an object, no id) are not sent; `qworker collect` answers them as error lines. Exit 0: all sent (and, with --follow, answered); 1: the broker refused some lines; 2: a bad flag, no broker, or (--follow) no result topics; 3: --follow timed out."""
    from qworker.messages import ChatMessage, Job, Sampling

    from pydantic import ValidationError

    s = _settings(bootstrap_servers)
    if job_id is not None and not job_id.strip():
        raise typer.BadParameter("must not be empty (leave --id out for a random one)", param_hint="--id")
    flag_jobs: list[object] = []
    if prompt is not None or chat is not None:
        try:
            sampling = Sampling(max_tokens=max_tokens, temperature=temperature)
            jid = job_id if job_id is not None else uuid.uuid4().hex[:12]
            if chat is not None:
                msgs = ([ChatMessage(role="system", content=system)] if system else []) + [ChatMessage(role="user", content=chat)]
                flag_jobs.append(Job(id=jid, messages=msgs, sampling=sampling, stream=stream, priority=priority, lora=lora))
            else:
                flag_jobs.append(Job(id=jid, prompt=prompt, sampling=sampling, stream=stream, priority=priority, lora=lora))
        except ValidationError as e:  # a bad flag: one line naming it, as a usage error (1 means "refused by the broker")
            err = e.errors()[0]
            flag = "--" + str(err["loc"][-1] if err["loc"] else "prompt").replace("_", "-")
            typer.echo(f"qworker: {flag}: {err['msg']}", err=True)
            raise typer.Exit(2) from None
    if file is None and not flag_jobs:
        raise typer.BadParameter("give --prompt, --chat or --file")
    lines = _read_batch(file) if file is not None else []
    if file is not None and not lines and not flag_jobs:
        typer.echo(f"qworker: {file} holds no lines; nothing submitted", err=True)
        raise typer.Exit(0)
    code = _kafka(s, _submit(s, flag_jobs, lines, follow, timeout_s))
    raise typer.Exit(code)


class _AtMostEvery(logging.Filter):
    """Lets one record through per ``seconds``: with the broker gone aiokafka logs every
    reconnection attempt (thousands of lines in a minute of ``collect``)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.last = seconds, -float("inf")

    def filter(self, record: logging.LogRecord) -> bool:
        now = time.monotonic()
        if now - self.last < self.seconds:
            return False
        self.last = now
        return True


def _kafka(s: WorkerSettings, coro):  # noqa: ANN001, ANN202
    """Run a client coroutine; a broker that cannot be reached, or result topics that do not
    exist, are one line and exit 2. aiokafka's own log lines are shown at most once per 30 s."""
    from aiokafka.errors import KafkaConnectionError

    from qworker.client import TopicsMissing

    aiokafka_log = logging.getLogger("aiokafka")
    if not aiokafka_log.handlers:  # a logger's filter would not see its children's records: a handler's does
        handler = logging.StreamHandler()
        handler.addFilter(_AtMostEvery(30.0))
        aiokafka_log.addHandler(handler)
        aiokafka_log.propagate = False

    try:
        return asyncio.run(coro)
    except KafkaConnectionError as e:
        typer.echo(f"qworker: cannot reach Kafka at {s.bootstrap_servers!r} ({e}); check QWORKER_BOOTSTRAP_SERVERS", err=True)
        raise typer.Exit(2) from None
    except TopicsMissing as e:
        typer.echo(f"qworker: {e}", err=True)
        raise typer.Exit(2) from None


def _read_batch(file: Path) -> list:
    from qworker.openai_batch.files import read_lines

    try:
        return read_lines(sys.stdin.buffer.read() if str(file) == "-" else file.read_bytes())
    except OSError as e:
        typer.echo(f"qworker: cannot read {file}: {e.strerror or e}", err=True)
        raise typer.Exit(2) from None


async def _submit(s: WorkerSettings, flag_jobs: list[object], lines: list, follow: bool, timeout_s: float) -> int:
    from qworker.openai_batch.progress import Progress
    from qworker.openai_batch.transfer import submit_lines
    from qworker.worker.client import ResultReader, submit as produce

    reader = None
    if follow:
        reader = ResultReader(s, [s.tokens_topic, s.completions_topic], from_beginning=False)
        await reader.start(timeout=min(20.0, timeout_s))  # before producing: no answer may be missed
    ids = await produce(s, flag_jobs) if flag_jobs else []  # type: ignore[arg-type]
    for i in ids:
        typer.echo(f"submitted {i}", err=True)
    code = 0
    if lines:
        progress = Progress("submit", sum(1 for ln in lines if ln.key is not None))
        rep = await submit_lines(s, lines, progress)
        progress.close()
        for ln in rep.skipped[:10]:
            typer.echo(f"line {ln.number}: {ln.problem}; not submitted", err=True)
        for ln, why in rep.refused[:10]:
            typer.echo(f"line {ln.number}: the producer refused it: {why}", err=True)
        typer.echo(rep.summary(), err=True)
        ids += [ln.key for ln in lines if ln.key is not None and all(ln is not r for r, _ in rep.refused)]
        code = 1 if rep.refused else 0
    if reader is None:
        return code
    try:
        unfinished = await _follow(reader, ids, timeout_s)
    finally:
        await reader.stop()
    if unfinished:
        typer.echo(f"qworker: gave up after {timeout_s:g} s: {len(unfinished)} job(s) not finished: {', '.join(sorted(unfinished)[:5])}", err=True)
        return 3
    return code


async def _follow(reader, ids: list[str], timeout_s: float) -> set[str]:
    """Print deltas (native) or chunk text (OpenAI) and each job's final answer, by record key.

    The tokens and completions topics are not ordered with each other, so a final answer is
    printed only once the reader has caught up (an empty poll, or past the tokens topic's end as
    it was when the answer was read: a busy topic is never quiet): the worker acknowledges every
    stream record before it sends the answer, so by then the stream's tail has been printed.
    Returns the ids still without an answer when ``timeout_s`` ran out."""
    import orjson

    from qworker.worker.client import parse

    tokens = reader.topics[0]
    waiting, finals, deadline = set(ids), {}, time.monotonic() + timeout_s
    ends: dict | None = None  # the tokens topic's end offsets when the last held answer was read
    while waiting and time.monotonic() < deadline:
        batches = await reader.consumer.getmany(timeout_ms=100, max_records=1000)
        recs = sorted((r for rs in batches.values() for r in rs), key=lambda r: r.topic != tokens)
        new = False
        for rec in recs:
            key = rec.key.decode("utf-8", "replace") if rec.key else None
            msg = parse(rec.value)
            if key not in waiting or not isinstance(msg, dict):
                continue
            if rec.topic != tokens:
                finals[key], new = msg, True
                continue
            text = msg.get("text", "") if msg.get("type") == "delta" else "".join(
                c.get("text") or (c.get("delta") or {}).get("content") or "" for c in msg.get("choices") or [])
            sys.stdout.write(text if len(ids) == 1 else f"[{key}] {text}\n")
            sys.stdout.flush()
        if new:  # an answer read now: its stream ends before the topic's end now
            ends = await reader.consumer.end_offsets([tp for tp in reader.consumer.assignment() if tp.topic == tokens])
        # caught up: an empty poll, or (a busy tokens topic is never quiet) past its end as it was then
        if finals and (not recs or await reader.caught_up(ends or {})):
            ends = None
            for key, msg in finals.items():
                waiting.discard(key)
                typer.echo("")
                typer.echo(orjson.dumps(msg).decode())
            finals.clear()
    return waiting


@app.command()
def collect(
    ids_from: Path = typer.Option(..., "--ids-from", help="The JSONL file that was submitted: one output line per input line"),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the OpenAI batch output lines (JSONL)"),
    timeout_s: float = typer.Option(600.0, "--timeout-s", "--timeout", help="Give up waiting after this many seconds; unanswered lines get status 504",
                                    callback=_seconds),
    since: float = typer.Option(0.0, help="Ignore results produced before this Unix time (a file submitted again reuses its ids)", callback=_unix_time),
    bootstrap_servers: Optional[str] = typer.Option(None, help="[QWORKER_BOOTSTRAP_SERVERS]"),
) -> None:
    """Write the answers to a submitted file as OpenAI batch output lines.

    Waits for every line's id on the completions topic, then writes one output line per input line, in input order (native results converted). Exit 0: every line succeeded; 1: some are errors; 2: no broker, or --out cannot be written (found before the wait; if it fails after, the lines go to a temporary file it names); 3: the wait timed out (unanswered lines are written as errors too)."""
    import tempfile

    from qworker.openai_batch.progress import Progress
    from qworker.openai_batch.transfer import collect_lines, unwritable, write_lines

    s = _settings(bootstrap_servers)
    lines = _read_batch(ids_from)
    why = unwritable(out)
    if why:  # found out now, not after the whole wait
        typer.echo(f"qworker: cannot write {out}: {why}", err=True)
        raise typer.Exit(2)
    progress = Progress("collect", len(lines))
    rep, results = _kafka(s, collect_lines(s, lines, None, timeout_s, since, progress))
    progress.close()
    try:
        write_lines(out, results)
    except OSError as e:  # it changed during the wait: the answers are kept elsewhere, not lost
        fd, spare = tempfile.mkstemp(prefix="qworker-collect-", suffix=".jsonl")
        os.close(fd)
        write_lines(Path(spare), results)
        typer.echo(f"qworker: cannot write {out} ({e.strerror or e}); the {len(results)} output lines are in {spare}", err=True)
        raise typer.Exit(2) from None
    typer.echo(rep.summary(str(out)), err=True)
    raise typer.Exit(3 if rep.timed_out else 1 if rep.failed else 0)


@app.command()
def broker(
    port: int = typer.Option(9092, min=1, max=65535, help="Port on 127.0.0.1"),
    partitions: int = typer.Option(8, min=1, help="Partitions of the jobs, tokens and completions topics it creates"),
    topics: bool = typer.Option(True, help="Create qworker's topics once it is up"),
) -> None:
    """Run the bundled broker (Tansu) in the foreground on loopback, to try qworker out.

    It keeps its data in memory; Ctrl-C or SIGTERM stops it (and the data is gone)."""
    import signal as sig

    from qworker.broker import HOST, Broker, port_free

    if not port_free(port):
        typer.echo(f"qworker: {HOST}:{port} is already in use; pick another --port", err=True)
        raise typer.Exit(2)
    b = Broker(port=port, inherit_output=True)
    stopping = []

    def stop(*_: object) -> None:
        if stopping:
            return  # already stopping: a second Ctrl-C must not cut b.stop() short
        stopping.append(True)
        raise KeyboardInterrupt

    # Ctrl-C reaches Tansu too (same process group): whichever notices first, it is a clean stop.
    # Installed before Tansu starts: a signal while it starts must stop it too, not orphan it.
    sig.signal(sig.SIGTERM, stop)
    sig.signal(sig.SIGINT, stop)
    try:
        try:
            b.start()
        except (RuntimeError, TimeoutError, OSError) as e:
            if stopping:
                raise KeyboardInterrupt from None  # it died of the same Ctrl-C
            typer.echo(f"qworker: the broker did not start: {e}", err=True)
            b.stop()
            raise typer.Exit(2) from None
        env = broker_env(b.bootstrap)
        if topics:
            from qworker.worker.client import create_topics

            try:
                created = asyncio.run(create_topics(_settings(b.bootstrap, enable_idempotence=False), partitions))
            except Exception as e:  # noqa: BLE001 - one line, and the broker goes too (finally)
                typer.echo(f"qworker: the broker started but creating the topics failed: {e}", err=True)
                raise typer.Exit(2) from None
            typer.echo(f"created topics: {', '.join(created) or 'none (all exist)'}")
        typer.echo(f"Tansu broker on {b.bootstrap} (in memory: its data goes when it stops). In other terminals:")
        typer.echo(f"  export {env}")
        typer.echo("  qworker run --model models/smollm2-135m")
        typer.echo("  qworker submit --file batch.jsonl && qworker collect --ids-from batch.jsonl --out results.jsonl")
        typer.echo("Ctrl-C stops it.")
        code = b.proc.wait() if b.proc is not None else 0
        if stopping or code in (-sig.SIGINT, 130):
            raise KeyboardInterrupt
        typer.echo(f"qworker: the broker exited with status {code}", err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        b.stop()
        typer.echo("broker stopped", err=True)
        raise typer.Exit(0) from None
    finally:
        b.stop()  # whatever ended it: never leave Tansu running behind us (a no-op once stopped)


def broker_env(bootstrap: str) -> str:
    """The environment for talking to the bundled broker: its address, no idempotence (Tansu
    refuses it), and the short timings its quirks want (see DESIGN.md)."""
    return (f"QWORKER_BOOTSTRAP_SERVERS={bootstrap} QWORKER_ENABLE_IDEMPOTENCE=false "
            "QWORKER_SESSION_TIMEOUT_MS=6000 QWORKER_HEARTBEAT_INTERVAL_MS=1000 QWORKER_FETCH_MAX_WAIT_MS=20")


@app.command()
def tail(
    from_beginning: bool = typer.Option(False, "--from-beginning", help="Start at the oldest records"),
    topic: list[str] = typer.Option([], help="Topics (default: tokens, completions, dlq)"),
    idle_timeout_s: Optional[float] = typer.Option(None, help="Exit after this long without records", callback=_seconds),
    bootstrap_servers: Optional[str] = typer.Option(None, help="[QWORKER_BOOTSTRAP_SERVERS]"),
) -> None:
    """Print result topics as JSON lines (DLQ records with their headers, as \\[key, value] pairs)."""
    s = _settings(bootstrap_servers)

    async def go() -> None:
        from qworker.worker.client import ResultReader

        import orjson

        reader = ResultReader(s, topic or None, from_beginning=from_beginning)
        await reader.start()
        try:
            async for rec in reader.records(idle_timeout=idle_timeout_s):
                out = {"topic": rec.topic, "partition": rec.partition, "offset": rec.offset}
                try:
                    out["value"] = orjson.loads(rec.value) if rec.value else None
                except orjson.JSONDecodeError:
                    out["value_raw"] = (rec.value or b"").decode("utf-8", "replace")
                if rec.headers:
                    # pairs, in order: a key may repeat (a dict kept only its last value)
                    out["headers"] = [[k, (v or b"").decode("utf-8", "replace")] for k, v in rec.headers]
                typer.echo(orjson.dumps(out).decode())
        finally:
            await reader.stop()

    _kafka(s, go())


@topics_app.command("create")
def topics_create(
    partitions: int = typer.Option(8, min=1, help="Partitions of the jobs, tokens and completions topics (>= max pods)"),
    replication: int = typer.Option(1, min=1, help="Replication factor"),
    bootstrap_servers: Optional[str] = typer.Option(None, help="[QWORKER_BOOTSTRAP_SERVERS]"),
) -> None:
    """Create the jobs, tokens, completions, DLQ and cancel topics (existing ones are kept)."""
    from qworker.worker.client import create_topics

    s = _settings(bootstrap_servers)
    created = _kafka(s, create_topics(s, partitions, replication))
    typer.echo(f"created: {', '.join(created) or 'nothing (all exist)'}")


@app.command("fetch-model")
def fetch_model(dest: Path = typer.Argument(Path("models/smollm2-135m")), force: bool = typer.Option(False)) -> None:
    """Download and convert SmolLM2-135M-Instruct into an HF folder (no-op if present)."""
    from qworker.model.fetch import fetch_model as fetch

    typer.echo(str(fetch(dest, force=force)))


if __name__ == "__main__":
    app()
