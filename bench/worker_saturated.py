"""Throughput through Kafka at saturation: every job sent at once to a real ``qworker run``,
against the same jobs through the engine alone, in one run.

    python bench/worker_saturated.py                  # peers.py's 48-request workload, 2 rounds
    python bench/worker_saturated.py --num-requests 128 --rounds 3

The workload is ``bench/peers.py``'s (``workloads.mixed``: prompts 16-256 tokens, outputs 32-256,
greedy, EOS ignored). The Kafka side starts the bundled broker on loopback, creates the topics,
starts one ``qworker run`` (defaults, ``--kv-memory-mib`` of KV, results streamed), sends every
job at once and times from the first send to the last completion as the client sees it. The
engine side runs the same jobs through ``AsyncEngine`` (the engine the worker wraps, stepping in
its own thread) in a fresh process, timed from submission to the last output. The two sides
alternate ``--rounds`` times (each round a fresh worker and a fresh engine process, a new seed so
no round hits another's prefix cache); the table gives each round and the medians. Checks: every
job exactly one completion, and the Kafka path's tokens equal the engine's on every job.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import drive, report, workloads  # noqa: E402
from bench.online import kafka_run  # noqa: E402
from qworker.demo import wait_ready  # noqa: E402


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a live process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def items_for(model: str, num: int, seed: int, outputs: str = "32,256") -> list[workloads.Item]:
    from transformers import AutoTokenizer

    return workloads.mixed(AutoTokenizer.from_pretrained(model), num=num, seed=seed, output_range=tuple(int(x) for x in outputs.split(",")))


def engine_side(model: str, num: int, seed: int, outputs: str, kv_mib: float, device: str, dtype: str) -> dict:
    """In this (fresh) process: the jobs through AsyncEngine, all submitted at once."""
    from qworker.engine import AsyncEngine

    items = items_for(model, num, seed, outputs)
    engine = drive.new_engine(model, device, dtype, kv_mib)
    drive.warm_up(engine)
    aeng = AsyncEngine(engine)

    async def one(i: int, it: workloads.Item) -> list[int]:
        toks: list[int] = []
        async for out in aeng.generate(f"e-{i}", it.prompt_ids, drive.greedy(it.max_tokens)):
            toks += out.outputs[0].token_ids
        return toks

    async def go() -> tuple[float, list[list[int]]]:
        await aeng.start()
        try:
            t0 = time.perf_counter()
            toks = await asyncio.gather(*(one(i, it) for i, it in enumerate(items)))
            return time.perf_counter() - t0, toks
        finally:
            await aeng.shutdown()

    cpu = time.process_time()
    seconds, toks = asyncio.run(go())
    return {"seconds": seconds, "tokens": toks, "cpu": {"engine": time.process_time() - cpu}}


def kafka_side(args, seed: int, logs: Path) -> dict:
    from qworker.broker import free_port, start_broker, stop_broker
    from qworker.config import WorkerSettings
    from qworker.worker.client import create_topics

    items = items_for(args.model, args.num_requests, seed, args.output_range)
    broker = start_broker(log_dir=logs)
    worker = None
    try:
        s = WorkerSettings(bootstrap_servers=broker.bootstrap, enable_idempotence=False, fetch_max_wait_ms=20, linger_ms=1, http_port=-1)
        asyncio.run(create_topics(s, partitions=args.partitions))
        port = free_port()
        env = dict(os.environ, QWORKER_BOOTSTRAP_SERVERS=broker.bootstrap, QWORKER_MODEL=args.model, QWORKER_ENABLE_IDEMPOTENCE="false",
                   # as bench/online.py: a short session, so the group's first join does not wait ~30 s on the broker
                   QWORKER_SESSION_TIMEOUT_MS="6000", QWORKER_HEARTBEAT_INTERVAL_MS="1000", QWORKER_HTTP_PORT=str(port), QWORKER_HTTP_HOST="127.0.0.1", QWORKER_KV_CACHE_MEMORY=f"{int(args.kv_memory_mib)}MiB",
                   QWORKER_LOG_LEVEL="WARNING", QWORKER_DEVICE=args.device, QWORKER_DTYPE=args.dtype)
        with open(logs / "worker.log", "ab") as out:
            worker = subprocess.Popen([sys.executable, "-m", "qworker.cli", "run"], env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_ready(port, worker, 300)
        warm = asyncio.run(kafka_run(s, items_for(args.model, 2, seed + 7, "4,8"), [0.0, 0.0], f"warm-{uuid.uuid4().hex[:6]}", 120))
        if warm["lost"] or warm["errors"]:
            raise RuntimeError(f"warm-up jobs failed: {warm}")
        pids = {"worker": worker.pid, "broker": broker.proc.pid}
        before = {k: process_cpu(p) for k, p in pids.items()} | {"client": time.process_time()}
        out = asyncio.run(kafka_run(s, items, [0.0] * len(items), f"k-{uuid.uuid4().hex[:6]}", args.timeout))
        # kafka_run ends with a 1 s wait for duplicates, in which these processes are near idle
        cpu = {k: process_cpu(p) - before[k] for k, p in pids.items()} | {"client": time.process_time() - before["client"]}
        worker.send_signal(signal.SIGTERM)
        worker.wait(90)
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(10)
        stop_broker(broker)
    recs = out["records"]
    span = max(r["sent"] + r["e2e"] for r in recs) - min(r["sent"] for r in recs) if recs else 0.0
    return {"seconds": span, "completed": len(recs), "lost": len(out["lost"]), "duplicated": len(out["duplicated"]),
            "errors": len(out["errors"]), "stream_mismatch": len(out["stream_mismatch"]), "cpu": cpu,
            "tokens": {r["id"].rsplit("-", 1)[1]: r["token_ids"] for r in recs}}


def main(argv: list[str] | None = None) -> dict:
    ap = report.parser(__doc__, quick_help="4 requests of 4-12 tokens, 1 round")
    ap.add_argument("--output-range", default="32,256", help="output tokens per job, MIN,MAX")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-memory-mib", type=float, default=1024)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--engine-side", help="internal: NUM,SEED runs the engine side here and prints JSON")
    args = ap.parse_args(argv)
    if args.engine_side:
        num, seed = (int(x) for x in args.engine_side.split(","))
        print(json.dumps(engine_side(args.model, num, seed, args.output_range, args.kv_memory_mib, args.device, args.dtype)))
        return {}
    if args.quick:
        args.num_requests, args.rounds, args.output_range = 4, 1, "4,12"
    result = report.meta(args.device, args.dtype)
    logs = Path(tempfile.mkdtemp(prefix="qworker-bench-saturated-"))
    rounds = []
    for k in range(args.rounds):
        seed = args.seed + 101 * k
        useful = sum(it.max_tokens for it in items_for(args.model, args.num_requests, seed, args.output_range))
        sides = {}
        for side in (("kafka", "engine") if k % 2 == 0 else ("engine", "kafka")):
            print(f"round {k + 1}: {side} ...", flush=True)
            if side == "kafka":
                sides[side] = kafka_side(args, seed, logs)
            else:
                cmd = [sys.executable, __file__, "--engine-side", f"{args.num_requests},{seed}", "--model", args.model,
                       "--kv-memory-mib", str(args.kv_memory_mib), "--device", args.device, "--dtype", args.dtype,
                       "--output-range", args.output_range]
                sides[side] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        kaf, eng = sides["kafka"], sides["engine"]
        differ = sum(kaf["tokens"].get(str(i)) != toks for i, toks in enumerate(eng["tokens"]))
        rounds.append({"kafka_tokens_per_s": useful / kaf["seconds"], "engine_tokens_per_s": useful / eng["seconds"],
                       "ratio": eng["seconds"] / kaf["seconds"], "completed": kaf["completed"], "lost": kaf["lost"],
                       "duplicated": kaf["duplicated"], "errors": kaf["errors"], "stream_mismatch": kaf["stream_mismatch"], "tokens_differ": differ,
                       "cpu_s": {"engine alone": eng["cpu"]["engine"], **kaf["cpu"]}})
        print(f"  kafka {rounds[-1]['kafka_tokens_per_s']:.1f} tok/s, engine {rounds[-1]['engine_tokens_per_s']:.1f} tok/s, "
              f"kafka / engine {rounds[-1]['ratio']:.2f}x, lost {kaf['lost']} dup {kaf['duplicated']} err {kaf['errors']}, "
              f"{differ} jobs' tokens differ from the engine's; CPU s: " + ", ".join(f"{k} {v:.1f}" for k, v in rounds[-1]["cpu_s"].items()), flush=True)
    result.update(num_requests=args.num_requests, output_range=args.output_range, rounds=rounds, median_ratio=statistics.median(r["ratio"] for r in rounds), logs=str(logs))
    print(markdown(result))
    return result


def markdown(r: dict) -> str:
    rows = [[i + 1, x["kafka_tokens_per_s"], x["engine_tokens_per_s"], f"{x['ratio']:.2f}x", x["cpu_s"]["worker"], x["cpu_s"]["engine alone"],
             x["cpu_s"]["broker"], x["cpu_s"]["client"], f"{x['completed']}/{r['num_requests']}",
             f"{x['lost']}/{x['duplicated']}/{x['errors']}/{x['stream_mismatch']}", x["tokens_differ"]] for i, x in enumerate(r["rounds"])]
    head = ["round", "Kafka tok/s", "engine tok/s", "Kafka / engine", "worker CPU s", "engine CPU s", "broker CPU s", "client CPU s", "completed",
            "lost/dup/err/stream", "tokens differ"]
    return "\n".join([report.header(r), "", report.table(head, rows), "", f"median Kafka / engine: {r['median_ratio']:.2f}x; "
                      f"median worker CPU / engine CPU: {statistics.median(x['cpu_s']['worker'] / x['cpu_s']['engine alone'] for x in r['rounds']):.2f}x"])


if __name__ == "__main__":
    main()
