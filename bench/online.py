"""Online: latency under load through the real broker and the real worker.

    python bench/online.py [--quick]

Starts the bundled Tansu broker (qworker.broker) on loopback, creates the topics, starts a real
``qworker run`` process (SIGTERM at the end, by pid) and, from this process, an open-loop
producer: Poisson arrivals at a fixed request rate, jobs sent when due whether or not earlier ones
have finished. A consumer on the tokens and completions topics timestamps every record as it
arrives here, so the latencies are what a client sees:

* TTFT: job sent -> first streamed delta received;
* TPOT: (completion received - first delta received) / (output tokens - 1);
* ITL: gaps between consecutive deltas of a job (the worker coalesces tokens produced within
  ``stream_interval_ms``, so one delta can carry more than one token);
* end-to-end: job sent -> completion received;

at p50 / p90 / p99, and throughput (output tokens and completions per second over the run). Each
run checks that every job got exactly one completion (none lost, none duplicated) and that the
streamed tokens add up to the completion's.

Rates are fractions (``--rates``) of the engine's offline capacity on the same kind of jobs,
measured first in this process (all jobs at once, requests/s, the engine stepping in a thread of
its own as in the worker), so the sweep shows where latency
bends. At ``--target-fraction`` (0.7) the same jobs and arrival times are also run through the
engine alone (``AsyncEngine``, the engine the worker wraps, in this process after the worker
has stopped) for the engine's own TTFT: the Kafka path's p50 TTFT over the engine's is what the broker, the consumer and
publishing add.

Workload: ``mixed`` from bench/workloads.py with shorter ranges (prompts 16-128, outputs 16-64
tokens, EOS ignored, greedy), a different seed per rate so no run hits another's prefix cache.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import drive, report, workloads  # noqa: E402
from bench.report import summary  # noqa: E402
from qworker.demo import wait_ready  # noqa: E402


def make_jobs(items: list[workloads.Item], tag: str):
    from qworker.messages import Job, Sampling

    return [
        Job(id=f"{tag}-{i}", prompt_token_ids=it.prompt_ids, sampling=Sampling(max_tokens=it.max_tokens, temperature=0.0, ignore_eos=True), stream=True)
        for i, it in enumerate(items)
    ]


async def kafka_run(s, items: list[workloads.Item], arrivals: list[float], tag: str, timeout: float) -> dict:
    """Open-loop producer + consumer for one rate; returns per-job records and the checks."""
    from qworker.messages import dumps
    from qworker.worker.client import ResultReader, parse, producer_for

    jobs = make_jobs(items, tag)
    ids = {j.id: i for i, j in enumerate(jobs)}
    reader = ResultReader(s, [s.tokens_topic, s.completions_topic], from_beginning=False, fetch_max_wait_ms=10)
    await reader.start()
    producer = await producer_for(s)
    sent: dict[str, float] = {}
    deltas: dict[str, list[tuple[float, dict]]] = {j: [] for j in ids}
    finals: dict[str, list[tuple[float, dict]]] = {j: [] for j in ids}
    done = asyncio.Event()  # every job has a final message
    stop = asyncio.Event()

    async def produce() -> None:
        t0 = time.time()
        futs = []
        for job, at in zip(jobs, arrivals):
            delay = t0 + at - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            sent[job.id] = time.time()
            futs.append(await producer.send(s.jobs_topic, value=dumps(job), key=job.id.encode()))
        await asyncio.gather(*futs)

    async def consume() -> None:
        while not stop.is_set():
            batches = await reader.consumer.getmany(timeout_ms=50, max_records=1000)
            now = time.time()
            for recs in batches.values():
                for r in recs:
                    msg = parse(r.value)
                    if not isinstance(msg, dict) or msg.get("job_id") not in ids:
                        continue
                    if msg.get("type") == "delta":
                        deltas[msg["job_id"]].append((now, msg))
                    else:
                        finals[msg["job_id"]].append((now, msg))
            if len(sent) == len(jobs) and all(finals.values()):
                done.set()

    consumer = asyncio.create_task(consume())
    start = time.time()
    try:
        await produce()
        try:
            await asyncio.wait_for(done.wait(), timeout=max(timeout - (time.time() - start), 1.0))
        except asyncio.TimeoutError:
            pass
        await asyncio.sleep(1.0)  # a grace period in which duplicates would show up
        stop.set()
        await consumer
    finally:
        if not consumer.done():
            consumer.cancel()
        await producer.stop()
        await reader.stop()
    return _records(jobs, sent, deltas, finals)


def _records(jobs, sent, deltas, finals) -> dict:
    recs, lost, dup, errors, mismatched = [], [], [], [], []
    for job in jobs:
        jid = job.id
        fin = finals[jid]
        if not fin:
            lost.append(jid)
            continue
        if len(fin) > 1:
            dup.append(jid)
        t_done, msg = fin[0]
        if msg.get("type") != "completion" or msg.get("status") != "ok":
            errors.append({"id": jid, "message": msg.get("error") or msg.get("status")})
            continue
        run = [(t, d) for t, d in deltas[jid] if d.get("run_id") == msg.get("run_id")]
        run.sort(key=lambda x: x[1]["seq"])
        streamed = [tok for _, d in run for tok in d["token_ids"]]
        if streamed != msg["choices"][0]["token_ids"] or [d["seq"] for _, d in run] != list(range(len(run))):
            mismatched.append(jid)
        n_out = msg["usage"]["completion_tokens"]
        times = sorted(t for t, _ in run)
        first = times[0] if times else t_done
        recs.append(
            {
                "id": jid,
                "prompt_tokens": msg["usage"]["prompt_tokens"],
                "output_tokens": n_out,
                "sent": sent[jid],
                "ttft": first - sent[jid],
                "e2e": t_done - sent[jid],
                "tpot": (t_done - first) / (n_out - 1) if n_out > 1 else None,
                "itl": [b - a for a, b in zip(times, times[1:])],
                "deltas": len(run),
                "token_ids": msg["choices"][0]["token_ids"],
                "worker_ttft": msg["timings"].get("ttft_s"),
                "worker_queue": msg["timings"].get("queue_s"),
            }
        )
    return {"records": recs, "lost": lost, "duplicated": dup, "errors": errors, "stream_mismatch": mismatched}


def stats_of(recs: list[dict], num_jobs: int, rate: float, arrivals: list[float]) -> dict:
    if recs:
        span = max(r["sent"] + r["e2e"] for r in recs) - min(r["sent"] for r in recs)
    else:
        span = 0.0
    toks = sum(r["output_tokens"] for r in recs)
    return {
        "rate": rate,
        "jobs": num_jobs,
        "completed": len(recs),
        "offered_rate": (len(arrivals) - 1) / arrivals[-1] if len(arrivals) > 1 and arrivals[-1] > 0 else rate,
        "seconds": span,
        "output_tokens_per_s": toks / span if span else 0.0,
        "completions_per_s": len(recs) / span if span else 0.0,
        "ttft_s": summary(r["ttft"] for r in recs),
        "tpot_s": summary(r["tpot"] for r in recs),
        "itl_s": summary(x for r in recs for x in r["itl"]),
        "e2e_s": summary(r["e2e"] for r in recs),
        "worker_ttft_s": summary(r["worker_ttft"] for r in recs),
        "tokens_per_delta": (toks - len(recs)) / max(sum(max(r["deltas"] - 1, 0) for r in recs), 1),
    }


def engine_alone(args, items, arrivals) -> dict:
    """The same jobs at the same arrival times through ``AsyncEngine`` (the engine the worker
    wraps, stepping in its own thread) in this process: the engine's own latencies."""
    from qworker.engine import AsyncEngine

    engine = drive.new_engine(args.model, args.device, args.dtype, args.kv_memory_mib)
    drive.warm_up(engine)
    aeng = AsyncEngine(engine)

    async def one(i: int, it: workloads.Item, t0: float, at: float) -> dict:
        delay = t0 + at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.time()
        first, n, times = None, 0, []
        async for out in aeng.generate(f"alone-{i}", it.prompt_ids, drive.greedy(it.max_tokens)):
            now = time.time()
            k = sum(len(o.token_ids) for o in out.outputs)
            if k:
                times.append(now)
                first = first or now
                n += k
        done = time.time()
        return {"output_tokens": n, "sent": sent, "ttft": first - sent, "e2e": done - sent, "tpot": (done - first) / (n - 1) if n > 1 else None, "itl": [b - a for a, b in zip(times, times[1:])]}

    async def go() -> list[dict]:
        await aeng.start()
        try:
            t0 = time.time()
            return await asyncio.gather(*(one(i, it, t0, at) for i, (it, at) in enumerate(zip(items, arrivals))))
        finally:
            await aeng.shutdown()

    recs = asyncio.run(go())
    del engine, aeng
    span = max(r["sent"] + r["e2e"] for r in recs) - min(r["sent"] for r in recs)
    return {
        "requests": len(recs),
        "seconds": span,
        "tokens_per_s": sum(r["output_tokens"] for r in recs) / span,
        "ttft_s": summary(r["ttft"] for r in recs),
        "tpot_s": summary(r["tpot"] for r in recs),
        "itl_s": summary(x for r in recs for x in r["itl"]),
        "e2e_s": summary(r["e2e"] for r in recs),
    }


def capacity_run(args, items) -> tuple[dict, str]:
    engine = drive.new_engine(args.model, args.device, args.dtype, args.kv_memory_mib)
    drive.warm_up(engine)
    run = drive.drive(engine, drive.jobs_for(items))
    return run.summary(), str(engine.runner.dtype)


def main(argv: list[str] | None = None) -> dict:
    ap = report.parser(__doc__, quick_help="two rates, 6 jobs each, short outputs")
    ap.add_argument("--kv-memory-mib", type=float, default=256)
    ap.add_argument("--rates", default="0.3,0.5,0.7,0.9,1.1", help="request rates as fractions of the offline capacity")
    ap.add_argument("--capacity", type=float, default=0.0, help="offline capacity in requests/s (0: measure it)")
    ap.add_argument("--capacity-requests", type=int, default=24, help="jobs in the capacity measurement")
    ap.add_argument("--target-fraction", type=float, default=0.7, help="rate (fraction) also run through the engine alone")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate (at least --min-requests jobs)")
    ap.add_argument("--min-requests", type=int, default=12)
    ap.add_argument("--prompt-range", default="16,128")
    ap.add_argument("--output-range", default="16,64")
    ap.add_argument("--timeout", type=float, default=180.0, help="per rate: give up waiting for completions after this long")
    ap.add_argument("--partitions", type=int, default=2)
    args = ap.parse_args(argv)
    if args.quick:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(rates="0.5,1.0", capacity_requests=6, duration=4.0, min_requests=6, output_range="4,12", prompt_range="16,64", timeout=90.0)
        args = ap.parse_args(argv)
    fractions = [float(x) for x in args.rates.split(",") if x]
    if args.target_fraction not in fractions:
        fractions = sorted(fractions + [args.target_fraction])
    p_range = tuple(int(x) for x in args.prompt_range.split(","))
    o_range = tuple(int(x) for x in args.output_range.split(","))

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)

    def items_for(k: int, num: int):
        return workloads.mixed(tok, num=num, seed=args.seed + 1000 * (k + 1), prompt_range=p_range, output_range=o_range)

    result = report.meta(args.device)
    result["workload"] = {"prompt_range": p_range, "output_range": o_range, "arrivals": "Poisson (open loop)", "duration_per_rate_s": args.duration}
    capacity = args.capacity
    if not capacity:
        print(f"offline capacity: {args.capacity_requests} jobs at once through the engine ...", flush=True)
        cap, result["dtype"] = report.run_threaded(capacity_run, args, items_for(-1, args.capacity_requests))
        capacity = cap["requests_per_s"]
        result["offline"] = {k: cap[k] for k in ("requests", "seconds", "tokens_per_s", "requests_per_s")}
    result["capacity_requests_per_s"] = capacity
    print(f"capacity {capacity:.3f} requests/s", flush=True)

    from qworker.broker import free_port, start_broker, stop_broker
    from qworker.config import WorkerSettings
    from qworker.worker.client import create_topics

    logs = Path(tempfile.mkdtemp(prefix="qworker-bench-online-"))
    result["logs"] = str(logs)
    broker = start_broker(log_dir=logs)
    worker = None
    runs = []
    plans = []
    try:
        s = WorkerSettings(bootstrap_servers=broker.bootstrap, enable_idempotence=False, session_timeout_ms=6000, heartbeat_interval_ms=1000, fetch_max_wait_ms=20, linger_ms=1, http_port=-1)
        asyncio.run(create_topics(s, partitions=args.partitions))
        port = free_port()
        worker_env = {
            "QWORKER_BOOTSTRAP_SERVERS": broker.bootstrap,
            "QWORKER_MODEL": str(args.model),
            "QWORKER_ENABLE_IDEMPOTENCE": "false",
            "QWORKER_SESSION_TIMEOUT_MS": "6000",
            "QWORKER_HEARTBEAT_INTERVAL_MS": "1000",
            "QWORKER_FETCH_MAX_WAIT_MS": "20",
            "QWORKER_LINGER_MS": "1",
            "QWORKER_STREAM_INTERVAL_MS": "20",
            "QWORKER_HTTP_PORT": str(port),
            "QWORKER_HTTP_HOST": "127.0.0.1",
            "QWORKER_DRAIN_TIMEOUT_S": "30",
            "QWORKER_KV_CACHE_MEMORY": f"{int(args.kv_memory_mib)}MiB",
            "QWORKER_DEVICE": args.device,
            "QWORKER_LOG_LEVEL": "WARNING",
        }
        if args.dtype != "auto":
            worker_env["QWORKER_DTYPE"] = args.dtype
        result["worker_settings"] = {k: v for k, v in worker_env.items() if k not in ("QWORKER_BOOTSTRAP_SERVERS", "QWORKER_HTTP_PORT")}
        with open(logs / "worker.log", "ab") as out:
            worker = subprocess.Popen([sys.executable, "-m", "qworker.cli", "run"], env=dict(os.environ, **worker_env), stdout=out, stderr=subprocess.STDOUT)
        print(f"worker pid {worker.pid}, broker {broker.bootstrap}; logs in {logs}", flush=True)
        wait_ready(port, worker, 300)
        warm = asyncio.run(kafka_run(s, items_for(-2, 2), [0.0, 0.0], f"warm-{uuid.uuid4().hex[:6]}", args.timeout))
        if warm["lost"] or warm["errors"]:
            raise RuntimeError(f"warm-up jobs failed: {warm}")
        for k, frac in enumerate(fractions):
            rate = frac * capacity
            num = max(args.min_requests, round(rate * args.duration))
            items = items_for(k, num)
            arrivals = drive.poisson(num, rate, seed=args.seed + k)
            plans.append((frac, rate, items, arrivals))
            print(f"kafka: rate {rate:.3f}/s ({frac:g} x capacity), {num} jobs ...", flush=True)
            out = asyncio.run(kafka_run(s, items, arrivals, f"r{k}-{uuid.uuid4().hex[:6]}", args.timeout + arrivals[-1]))
            st = stats_of(out["records"], num, rate, arrivals)
            st.update(fraction=frac, lost=len(out["lost"]), duplicated=len(out["duplicated"]), errors=out["errors"], stream_mismatch=len(out["stream_mismatch"]))
            runs.append(st)
            print(f"  TTFT p50 {st['ttft_s']['p50']:.3f}s p99 {st['ttft_s']['p99']:.3f}s, e2e p50 {st['e2e_s']['p50']:.2f}s, lost {st['lost']}, dup {st['duplicated']}", flush=True)
        worker.send_signal(signal.SIGTERM)
        result["worker_exit_code"] = worker.wait(90)
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(10)
        stop_broker(broker)
    result["kafka"] = runs
    result.setdefault("dtype", "")

    frac, rate, items, arrivals = next(p for p in plans if p[0] == args.target_fraction)
    print(f"engine alone at {rate:.3f}/s (same jobs and arrival times) ...", flush=True)
    eng = engine_alone(args, items, arrivals)
    kaf = next(r for r in runs if r["fraction"] == args.target_fraction)
    result["engine_at_target"] = {"fraction": frac, "rate": rate, **eng}
    result["target"] = {
        "fraction": frac,
        "kafka_ttft_p50_s": kaf["ttft_s"]["p50"],
        "engine_ttft_p50_s": eng["ttft_s"]["p50"],
        "ttft_p50_ratio": kaf["ttft_s"]["p50"] / eng["ttft_s"]["p50"],
        "lost_total": sum(r["lost"] for r in runs),
        "duplicated_total": sum(r["duplicated"] for r in runs),
        "errors_total": sum(len(r["errors"]) for r in runs),
    }
    report.publish(result, "online", args.out, plot, markdown)
    return result


def markdown(r: dict) -> str:
    w = r["workload"]
    lines = [
        report.header(r),
        "",
        f"online through Tansu + `qworker run`: prompts {w['prompt_range'][0]}-{w['prompt_range'][1]}, outputs {w['output_range'][0]}-{w['output_range'][1]} tokens, "
        f"Poisson arrivals; offline capacity {r['capacity_requests_per_s']:.3f} requests/s",
        "",
    ]
    rows = []
    for x in r["kafka"]:
        rows.append(
            [
                f"{x['rate']:.3f} ({x['fraction']:g}x)",
                x["completed"],
                x["ttft_s"]["p50"],
                x["ttft_s"]["p90"],
                x["ttft_s"]["p99"],
                x["tpot_s"]["p50"],
                x["tpot_s"]["p99"],
                x["itl_s"]["p50"],
                x["itl_s"]["p99"],
                x["e2e_s"]["p50"],
                x["e2e_s"]["p90"],
                x["e2e_s"]["p99"],
                x["output_tokens_per_s"],
                f"{x['lost']}/{x['duplicated']}/{len(x['errors'])}",
            ]
        )
    lines.append(
        report.table(
            ["rate/s", "done", "TTFT p50", "p90", "p99", "TPOT p50", "p99", "ITL p50", "p99", "e2e p50", "p90", "p99", "out tok/s", "lost/dup/err"],
            rows,
        )
    )
    e, t = r["engine_at_target"], r["target"]
    lines += [
        "",
        f"at {t['fraction']:g}x capacity ({e['rate']:.3f}/s): Kafka-path TTFT p50 {t['kafka_ttft_p50_s']:.3f} s vs the engine's own {t['engine_ttft_p50_s']:.3f} s "
        f"({t['ttft_p50_ratio']:.2f}x); engine alone e2e p50 {e['e2e_s']['p50']:.2f} s, {e['tokens_per_s']:.1f} output tokens/s. "
        f"Lost {t['lost_total']}, duplicated {t['duplicated_total']}, errors {t['errors_total']} over all rates.",
    ]
    return "\n".join(lines)


def plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    rates = [x["rate"] for x in r["kafka"]]
    for ax, key, name in ((axes[0], "ttft_s", "time to first token"), (axes[1], "e2e_s", "end-to-end latency")):
        report.latency_vs_rate(ax, rates, {p: [x[key][p] for x in r["kafka"]] for p in ("p50", "p90", "p99")}, "seconds", f"{name} (Kafka path)")
        ax.axvline(r["capacity_requests_per_s"], color="gray", ls=":", lw=1)
    e = r["engine_at_target"]
    axes[0].plot([e["rate"]], [e["ttft_s"]["p50"]], "k*", ms=10, label="engine alone, p50")
    axes[0].legend(fontsize=7)
    ax = axes[2]
    ax.plot(rates, [x["output_tokens_per_s"] for x in r["kafka"]], marker="o", label="output tokens/s")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(rates, [x["tpot_s"]["p50"] for x in r["kafka"]], marker="s", color="tab:orange", label="TPOT p50 (s)")
    ax2.set_ylabel("TPOT p50 (s)")
    ax.set_title("throughput and time per output token", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ax2.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
