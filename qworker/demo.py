"""``python -m qworker.demo --model DIR`` (``make demo``): the whole system on one machine.

Starts the bundled Tansu broker on a free loopback port, fetches the model if missing, starts a
``qworker run`` process, submits a handful of jobs (two share a long system prompt, one is a
chat, one extracts JSON under a schema (structured output), one gets cancelled, one is invalid), streams their tokens live in the terminal, prints a
summary table, and stops everything cleanly (the worker by SIGTERM, the broker by pid).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from qworker.broker import free_port, start_broker, stop_broker
from qworker.config import WorkerSettings
from qworker.messages import ChatMessage, Job, Sampling
from qworker.worker.client import ResultReader, cancel, create_topics, parse, submit

SYSTEM = (
    "You are the support assistant of a small bakery in Lyon. You answer briefly and politely, "
    "you never invent prices, and you recommend the croissants, the pain au chocolat and the "
    "seasonal fruit tarts. Opening hours are 7am to 7pm, Tuesday to Sunday."
)


def demo_jobs() -> list[Job]:
    greedy = Sampling(max_tokens=32, temperature=0.0)
    sys_msg = ChatMessage(role="system", content=SYSTEM)
    return [
        Job(id="bakery-hours", messages=[sys_msg, ChatMessage(role="user", content="When are you open?")], sampling=greedy, stream=True),
        Job(id="bakery-tip", messages=[sys_msg, ChatMessage(role="user", content="What should I buy today?")], sampling=greedy, stream=True),
        Job(id="chat-kafka", messages=[ChatMessage(role="user", content="Explain Kafka consumer groups in one sentence.")], sampling=greedy, stream=True),
        # structured output: the completion is JSON that validates against the schema
        Job(id="extract-json", messages=[ChatMessage(role="user", content="Extract the order as JSON: two croissants and one fruit tart, to pick up at 8am.")],
            sampling=Sampling(max_tokens=96, temperature=0.0), response_format=EXTRACT, stream=True),
        Job(id="story-cancelled", prompt="Once upon a time, in a data centre far away,", sampling=Sampling(max_tokens=200, temperature=0.8, seed=1), stream=True),
    ]


EXTRACT = {
    "type": "json_schema",
    "json_schema": {
        "name": "order",
        "schema": {
            "type": "object",
            "properties": {
                "items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
                    "type": "object",
                    "properties": {"product": {"enum": ["croissant", "pain au chocolat", "fruit tart"]}, "quantity": {"type": "integer", "minimum": 1, "maximum": 12}},
                    "required": ["product", "quantity"]}},
                "pickup": {"type": "string", "pattern": "^[0-9]{1,2}(am|pm)$"},
            },
            "required": ["items", "pickup"],
        },
    },
}

INVALID = {"id": "invalid-job", "prompt": "hello", "sampling": {"max_tokens": -3}}


def wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the worker exited with {proc.returncode}")
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError("the worker did not become ready")


def render(jobs: list[str], text: dict[str, str], final: dict[str, dict]) -> Table:
    t = Table(title="qworker demo: live tokens", expand=True)
    t.add_column("job", no_wrap=True)
    t.add_column("status", no_wrap=True)
    t.add_column("text")
    for j in jobs:
        f = final.get(j)
        status = "streaming" if f is None else (f["status"] if f["type"] == "completion" else f"error: {f['error']['code']}")
        body = text.get(j, "") if f is None or f["type"] == "completion" else f["error"]["message"]
        t.add_row(j, status, body.replace("\n", " ")[-300:])
    return t


@contextmanager
def live_view(console: Console, table: Table) -> Iterator[Live]:
    """A live table that leaves the cursor on a fresh line when it ends.

    On a terminal rich ends a ``Live`` with a newline itself; written to a file or a pipe
    (``make demo | tee log``) it prints the last frame without one, so whatever came next (the
    summary's title) was drawn on the table's bottom border."""
    with Live(table, console=console, refresh_per_second=8) as live:
        yield live
    if not console.is_terminal:
        console.line()


def summary(jobs: list[str], final: dict[str, dict]) -> Table:
    t = Table(title="summary")
    for col in ("job", "finish", "TTFT s", "tokens", "tokens/s", "cached prompt tokens"):
        t.add_column(col)
    for j in jobs:
        f = final.get(j)
        if f is None:
            t.add_row(j, "missing", "", "", "", "")
        elif f["type"] == "error":
            t.add_row(j, f"error {f['error']['code']}", "", "", "", "")
        else:
            tm, ch = f["timings"], f["choices"][0]
            n = f["usage"]["completion_tokens"]
            decode_s = (tm["total_s"] or 0) - (tm["ttft_s"] or 0)
            rate = f"{(n - 1) / decode_s:.1f}" if n > 1 and decode_s > 0 else ""
            t.add_row(j, ch["finish_reason"], f"{tm['ttft_s']:.2f}" if tm["ttft_s"] is not None else "", str(n), rate, str(f["usage"]["cached_tokens"]))
    return t


async def run_demo(s: WorkerSettings, console: Console, timeout: float) -> dict[str, dict]:
    jobs = demo_jobs()
    order = [j.id for j in jobs] + [INVALID["id"]]
    text: dict[str, str] = {}
    final: dict[str, dict] = {}
    reader = ResultReader(s, [s.tokens_topic, s.completions_topic], from_beginning=True)
    await reader.start()
    try:
        # the shared-prefix pair goes first, one after the other, so the second hits the prefix cache
        await submit(s, [jobs[0]])
        await asyncio.sleep(1.0)
        await submit(s, jobs[1:] + [INVALID])  # type: ignore[list-item]
        cancelled = False
        deadline = time.monotonic() + timeout
        with live_view(console, render(order, text, final)) as live:
            async for rec in reader.records(idle_timeout=timeout):
                msg = parse(rec.value)
                if not isinstance(msg, dict) or msg.get("job_id") not in order:
                    continue
                if msg["type"] == "delta":
                    text[msg["job_id"]] = text.get(msg["job_id"], "") + msg["text"]
                else:
                    final[msg["job_id"]] = msg
                if not cancelled and len(text.get("story-cancelled", "")) > 20:
                    await cancel(s, "story-cancelled", reason="demo")
                    cancelled = True
                live.update(render(order, text, final))
                if len(final) == len(order) or time.monotonic() > deadline:
                    break
    finally:
        await reader.stop()
    console.print(summary(order, final))
    ex = final.get("extract-json")
    if ex is not None and ex["type"] == "completion":
        text = ex["choices"][0]["text"]
        try:
            json.loads(text)
            verdict = "parses as JSON"
        except ValueError:
            verdict = f"does not parse (finish_reason {ex['choices'][0]['finish_reason']!r}: a valid prefix)"
        console.print(f"structured output (extract-json, response_format json_schema): {text}  -> {verdict}")
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args(argv)
    console = Console()
    model = Path(args.model)
    if not (model / "config.json").exists():
        from qworker.model.fetch import fetch_model

        console.print(f"fetching the model into {model} ...")
        fetch_model(model)
    logs = Path(tempfile.mkdtemp(prefix="qworker-demo-"))
    broker = start_broker(log_dir=logs)
    worker = None
    try:
        s = WorkerSettings(
            bootstrap_servers=broker.bootstrap, enable_idempotence=False, session_timeout_ms=6000, heartbeat_interval_ms=1000, fetch_max_wait_ms=20,
            stream_interval_ms=50, linger_ms=1,
        )
        asyncio.run(create_topics(s, partitions=2))
        console.print(f"broker on {broker.bootstrap} (pid {broker.proc.pid}); logs in {logs}")
        port = free_port()
        env = dict(os.environ, QWORKER_BOOTSTRAP_SERVERS=broker.bootstrap, QWORKER_MODEL=str(model), QWORKER_ENABLE_IDEMPOTENCE="false",
                   QWORKER_SESSION_TIMEOUT_MS="6000", QWORKER_HEARTBEAT_INTERVAL_MS="1000", QWORKER_FETCH_MAX_WAIT_MS="20",
                   QWORKER_HTTP_PORT=str(port), QWORKER_HTTP_HOST="127.0.0.1", QWORKER_DRAIN_TIMEOUT_S="30")
        with open(logs / "worker.log", "ab") as out:
            worker = subprocess.Popen([sys.executable, "-m", "qworker.cli", "run"], env=env, stdout=out, stderr=subprocess.STDOUT)
        console.print(f"worker pid {worker.pid}: loading the model ...")
        wait_ready(port, worker, 300)
        final = asyncio.run(run_demo(s, console, args.timeout))
        worker.send_signal(signal.SIGTERM)
        rc = worker.wait(60)
        console.print(f"worker drained and exited with {rc}")
        ok = rc == 0 and len(final) == len(demo_jobs()) + 1 and final.get("invalid-job", {}).get("type") == "error"
        ok = ok and final.get("extract-json", {}).get("type") == "completion"
        return 0 if ok else 1
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(10)
        stop_broker(broker)


if __name__ == "__main__":
    raise SystemExit(main())
