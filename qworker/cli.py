"""qworker: run the worker, submit jobs, tail results, create topics, fetch the model."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from pathlib import Path
from typing import Optional

import typer

from qworker.config import WorkerSettings

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
topics_app = typer.Typer(no_args_is_help=True, help="Manage qworker's topics.")
app.add_typer(topics_app, name="topics")


def _parse_options(options: list[str]) -> dict[str, str]:
    out = {}
    for o in options:
        if "=" not in o:
            raise typer.BadParameter(f"expected KEY=VALUE, got {o!r}")
        k, v = o.split("=", 1)
        out[k.strip().lower().replace("-", "_")] = v
    return out


def _settings(bootstrap_servers: str | None = None, **kw: object) -> WorkerSettings:
    return WorkerSettings.from_env(bootstrap_servers=bootstrap_servers, **kw)


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
    option: list[str] = typer.Option([], "--option", "-o", help="Any other setting as KEY=VALUE (e.g. -o session_timeout_ms=6000)"),
) -> None:
    """Run the worker until SIGTERM (which drains, commits and exits 0)."""
    from pydantic import ValidationError

    try:
        settings = _settings(
            bootstrap_servers, model=model, group_id=group_id, http_port=http_port, drain_timeout_s=drain_timeout_s,
            max_waiting_jobs=max_waiting_jobs, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs, device=device, dtype=dtype,
            **_parse_options(option),
        )
    except ValidationError as e:  # a misconfiguration: one line naming the variable, no traceback
        typer.echo(f"qworker: {WorkerSettings.explain(e)}", err=True)
        raise typer.Exit(2) from None
    if settings.log_format == "json":
        from qworker.telemetry import configure_json_logging

        configure_json_logging(settings.log_level.upper())
    else:
        logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
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
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="JSONL file of jobs ('-' for stdin)"),
    job_id: Optional[str] = typer.Option(None, "--id", help="Job id (default: random)"),
    max_tokens: int = typer.Option(32, help="max_tokens"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    priority: int = typer.Option(0, help="Lower runs first"),
    stream: bool = typer.Option(True, help="Stream tokens to the tokens topic"),
    follow: bool = typer.Option(False, "--follow", help="Print the streamed result until every job finished"),
    timeout_s: float = typer.Option(300.0, help="--follow gives up after this long"),
    bootstrap_servers: Optional[str] = typer.Option(None, help="[QWORKER_BOOTSTRAP_SERVERS]"),
) -> None:
    """Produce jobs from flags or a JSONL file."""
    from qworker.messages import ChatMessage, Job, Sampling, loads

    s = _settings(bootstrap_servers)
    jobs: list[object] = []
    if file is not None:
        lines = sys.stdin.read().splitlines() if str(file) == "-" else file.read_text().splitlines()
        for line in lines:
            if line.strip():
                jobs.append(loads(line.encode()))
    if prompt is not None or chat is not None:
        sampling = Sampling(max_tokens=max_tokens, temperature=temperature)
        jid = job_id or uuid.uuid4().hex[:12]
        if chat is not None:
            msgs = ([ChatMessage(role="system", content=system)] if system else []) + [ChatMessage(role="user", content=chat)]
            jobs.append(Job(id=jid, messages=msgs, sampling=sampling, stream=stream, priority=priority))
        else:
            jobs.append(Job(id=jid, prompt=prompt, sampling=sampling, stream=stream, priority=priority))
    if not jobs:
        raise typer.BadParameter("give --prompt, --chat or --file")
    asyncio.run(_submit(s, jobs, follow, timeout_s))


async def _submit(s: WorkerSettings, jobs: list[object], follow: bool, timeout_s: float) -> None:
    from qworker.worker.client import ResultReader, parse, submit as produce

    reader = None
    if follow:
        reader = ResultReader(s, [s.tokens_topic, s.completions_topic], from_beginning=False)
        await reader.start()
    ids = await produce(s, jobs)  # type: ignore[arg-type]
    for i in ids:
        typer.echo(f"submitted {i}", err=True)
    if reader is None:
        return
    waiting, deadline = set(ids), time.monotonic() + timeout_s
    try:
        async for rec in reader.records(idle_timeout=timeout_s):
            msg = parse(rec.value)
            if not isinstance(msg, dict) or msg.get("job_id") not in waiting:
                continue
            if msg.get("type") == "delta":
                sys.stdout.write(msg["text"] if len(ids) == 1 else f"[{msg['job_id']}] {msg['text']}\n")
                sys.stdout.flush()
            else:
                waiting.discard(msg["job_id"])
                typer.echo("")
                import orjson

                typer.echo(orjson.dumps(msg).decode())
            if not waiting or time.monotonic() > deadline:
                break
    finally:
        await reader.stop()


@app.command()
def tail(
    from_beginning: bool = typer.Option(False, "--from-beginning", help="Start at the oldest records"),
    topic: list[str] = typer.Option([], help="Topics (default: tokens, completions, dlq)"),
    idle_timeout_s: Optional[float] = typer.Option(None, help="Exit after this long without records"),
    bootstrap_servers: Optional[str] = typer.Option(None, help="[QWORKER_BOOTSTRAP_SERVERS]"),
) -> None:
    """Print result topics as JSON lines (DLQ records with their headers)."""
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
                    out["headers"] = {k: v.decode("utf-8", "replace") for k, v in rec.headers}
                typer.echo(orjson.dumps(out).decode())
        finally:
            await reader.stop()

    asyncio.run(go())


@topics_app.command("create")
def topics_create(
    partitions: int = typer.Option(8, help="Partitions of the jobs, tokens and completions topics (>= max pods)"),
    replication: int = typer.Option(1, help="Replication factor"),
    bootstrap_servers: Optional[str] = typer.Option(None, help="[QWORKER_BOOTSTRAP_SERVERS]"),
) -> None:
    """Create the jobs, tokens, completions, DLQ and cancel topics (existing ones are kept)."""
    from qworker.worker.client import create_topics

    created = asyncio.run(create_topics(_settings(bootstrap_servers), partitions, replication))
    typer.echo(f"created: {', '.join(created) or 'nothing (all exist)'}")


@app.command("fetch-model")
def fetch_model(dest: Path = typer.Argument(Path("models/smollm2-135m")), force: bool = typer.Option(False)) -> None:
    """Download and convert SmolLM2-135M-Instruct into an HF folder (no-op if present)."""
    from qworker.model.fetch import fetch_model as fetch

    typer.echo(str(fetch(dest, force=force)))


if __name__ == "__main__":
    app()
