"""Worker throughput with tracing on (in-memory exporter) against tracing off, through the broker.

    python bench/telemetry_overhead.py --model models/smollm2-135m --jobs 32 --rounds 3

One Tansu broker and one engine for the whole run; each run gets fresh topics and a fresh
``Worker``, is fed ``--jobs`` streaming jobs at once (random prompts, ``--max-tokens`` output
tokens each, EOS ignored) and is timed from the first produce to the last completion read back.
Modes alternate ABBA (off, on, on, off, ...) so a drift in machine load hits both alike.
"off" is the default production state with no ``OTEL_*`` variables (the no-op tracer; metrics
stay on, they are always on); "on" records every span through the SDK's batch processor into
an ``InMemorySpanExporter``. Reports useful output tokens/s per run, the median per mode and the
overhead (off/on - 1); on a shared, loaded machine that figure carries the load's noise, so it
also reports the CPU time of the event-loop thread per mode and, measured directly, the CPU time
spent inside the telemetry calls (``Accounting``) per second of run: its on-minus-off difference
is the share of the event loop that tracing takes, an upper bound on the throughput it can cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from qworker.broker import start_broker, stop_broker  # noqa: E402
from qworker.config import WorkerSettings  # noqa: E402
from qworker.messages import Job, Sampling  # noqa: E402
from qworker.telemetry.tracing import Tracing, disabled, from_provider  # noqa: E402
from qworker.worker import Worker  # noqa: E402
from qworker.worker.client import ResultReader, create_topics, parse, submit  # noqa: E402


class Accounting:
    """CPU time (``time.thread_time``) spent inside telemetry calls, counted at the outermost
    call only. Installed by wrapping the telemetry entry points the worker uses, so the figure
    is the CPU tracing and metrics take from the event loop, free of the machine's load noise."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self._depth = 0

    def wrap(self, owner: object, name: str) -> None:
        fn = getattr(owner, name)
        acct = self

        def timed(*args, **kwargs):
            if acct._depth:
                return fn(*args, **kwargs)
            acct._depth += 1
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acct.cpu_s += time.thread_time() - t
                acct._depth -= 1

        setattr(owner, name, timed)

    def install(self) -> None:
        from qworker.telemetry import genai, job, metrics, spans

        for name in ("job", "dead_letter"):
            self.wrap(job.Telemetry, name)
        for name in ("queued", "admitted", "generating", "on_output", "generated", "failed", "stream_headers", "outcome"):
            self.wrap(job.JobTelemetry, name)
        # publish() is a context manager around an await: count its span work, not the wait
        for name in ("child", "end"):
            self.wrap(spans.JobTrace, name)
        self.wrap(spans, "inject")
        self.wrap(metrics.WorkerMetrics, "update_worker")
        self.wrap(metrics.WorkerMetrics, "set_consumer_lag")
        del genai  # its calls are reached through the wrapped entry points


ACCOUNT = Accounting()


def settings(bootstrap: str) -> WorkerSettings:
    tag = uuid.uuid4().hex[:8]
    return WorkerSettings(
        bootstrap_servers=bootstrap,
        group_id=f"bench-{tag}",
        jobs_topic=f"jobs-{tag}",
        tokens_topic=f"tokens-{tag}",
        completions_topic=f"completions-{tag}",
        dlq_topic=f"dlq-{tag}",
        cancel_topic=f"cancel-{tag}",
        enable_idempotence=False,  # Tansu
        session_timeout_ms=6000,
        heartbeat_interval_ms=500,
        fetch_max_wait_ms=20,
        http_port=-1,
        max_waiting_jobs=64,
    )


async def one_run(bootstrap: str, engine, jobs: list[Job], tracing: Tracing) -> dict:
    s = settings(bootstrap)
    await create_topics(s, partitions=4)
    reader = ResultReader(s, [s.completions_topic])
    await reader.start()
    w = Worker(s, engine, tracing=tracing)
    await w.start()
    await asyncio.sleep(1.0)  # let the group settle before the clock starts
    tokens = done = 0
    t0 = time.perf_counter()
    # CPU of this thread (the event loop: consumer, admission, spans, metrics, publishing) and
    # of the whole process; the engine thread's work is the same in both modes
    loop0, proc0, tele0 = time.thread_time(), time.process_time(), ACCOUNT.cpu_s
    await submit(s, jobs)
    async for rec in reader.records():
        msg = parse(rec.value)
        tokens += msg["usage"]["completion_tokens"]
        done += 1
        if done == len(jobs):
            break
    elapsed = time.perf_counter() - t0
    loop_cpu, proc_cpu, tele_cpu = time.thread_time() - loop0, time.process_time() - proc0, ACCOUNT.cpu_s - tele0
    await w.stop()
    await reader.stop()
    return {"seconds": elapsed, "tokens": tokens, "tokens_per_s": tokens / elapsed, "loop_cpu_s": loop_cpu, "process_cpu_s": proc_cpu, "telemetry_cpu_s": tele_cpu}


async def main_async(args: argparse.Namespace) -> dict:
    from qworker.engine import AsyncEngine

    rng = random.Random(args.seed)
    engine = AsyncEngine.from_model(args.model, device=args.device, kv_cache_memory=args.kv_memory_mib << 20)
    await engine.start()
    broker = start_broker(log_dir=Path(tempfile.mkdtemp(prefix="tansu-")))
    runs: list[dict] = []
    try:
        order = []
        for r in range(args.rounds):
            order += ["off", "on"] if r % 2 == 0 else ["on", "off"]
        for i, mode in enumerate(order):
            jobs = [
                Job(id=f"j{i}-{k}", prompt_token_ids=[rng.randrange(100, 30000) for _ in range(args.prompt_tokens)], sampling=Sampling(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True), stream=True)
                for k in range(args.jobs)
            ]
            exporter = InMemorySpanExporter()
            tracing = disabled()
            if mode == "on":
                provider = TracerProvider()
                provider.add_span_processor(BatchSpanProcessor(exporter))
                tracing = from_provider(provider)
            res = await one_run(broker.bootstrap, engine, jobs, tracing)  # Worker.stop flushes the spans
            tracing.shutdown()
            res.update(mode=mode, spans=len(exporter.get_finished_spans()))
            runs.append(res)
            print(json.dumps(res), flush=True)
    finally:
        stop_broker(broker)
        await engine.shutdown()
    def median(key: str, mode: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode)

    med = {m: median("tokens_per_s", m) for m in ("off", "on")}
    loop = {m: median("loop_cpu_s", m) for m in ("off", "on")}
    proc_off = median("process_cpu_s", "off")
    # telemetry CPU per second of run: what tracing adds is on minus off (metrics are in both)
    tele = {m: statistics.median(r["telemetry_cpu_s"] / r["seconds"] for r in runs if r["mode"] == m) for m in ("off", "on")}
    return {
        "args": vars(args),
        "runs": runs,
        "median_tokens_per_s": med,
        "overhead_pct": 100 * (med["off"] / med["on"] - 1),
        "median_loop_cpu_s": loop,
        # the CPU tracing adds on the loop, as a share of all the CPU a run takes
        "loop_cpu_overhead_pct": 100 * (loop["on"] - loop["off"]) / proc_off,
        "telemetry_cpu_pct_of_wall": {m: 100 * v for m, v in tele.items()},
        "tracing_cpu_overhead_pct": 100 * (tele["on"] - tele["off"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--jobs", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="pairs of runs (one off, one on)")
    ap.add_argument("--kv-memory-mib", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ACCOUNT.install()
    result = asyncio.run(main_async(args))
    print(json.dumps({k: result[k] for k in ("median_tokens_per_s", "overhead_pct", "median_loop_cpu_s", "loop_cpu_overhead_pct", "telemetry_cpu_pct_of_wall", "tracing_cpu_overhead_pct")}))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
