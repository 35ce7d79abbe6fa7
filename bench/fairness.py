"""Fairness on the head-of-line workload: short jobs arriving behind a few very long ones.

    python bench/fairness.py [--quick]

Workload (bench/workloads.py ``head_of_line``): long jobs (1024-token prompts, 384 output tokens)
all arrive at t=0; short jobs (16-48-token prompts, 8-24 output tokens) arrive on a steady schedule
behind them (``--short-rate`` per second from ``--short-start`` s), EOS ignored, greedy. Engine runs
in one process, each with the same arrival offsets:

* mixed: longs and shorts together;
* shorts alone: the same short jobs at the same times, no long jobs;
* longs alone: the long jobs only.

Reports the short jobs' TTFT and end-to-end latency (p50/p99) mixed vs alone, and the long jobs'
output tokens/s mixed vs alone. With ``--hf`` (default on, off in ``--quick``) also HF transformers
one request at a time in FCFS order: each job's service time is measured with ``generate`` (all
shorts, a sample of the longs, the sample mean standing for the rest) and the queue is replayed
against the same arrival times - what a one-at-a-time server would give the short jobs.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import drive, hf_baseline, report, workloads  # noqa: E402
from bench.report import summary  # noqa: E402


def run_engine(args, jobs) -> dict:
    engine = drive.new_engine(args.model, args.device, args.dtype, args.kv_memory_mib, max_num_seqs=256)
    drive.warm_up(engine)
    run = drive.drive(engine, jobs)
    out = {"short": run.summary("short"), "long": run.summary("long"), "seconds": run.seconds, "timeline": run.timeline}
    out["per_request"] = [{k: r[k] for k in ("id", "group", "arrival", "ttft", "e2e")} for r in run.requests]
    out["preemptions"] = run.counters["preemptions_swap"] + run.counters["preemptions_recompute"]
    out["kv_blocks_total"] = run.counters["kv_blocks_total"]
    out["dtype"] = str(engine.runner.dtype)
    del engine
    return out


def hf_fcfs(args, tok, items, arrivals, dtype) -> dict:
    """One-at-a-time HF server, FCFS: measured service times replayed against the arrivals."""
    model = hf_baseline.load_hf(args.model, args.device, dtype)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    longs = [i for i, it in enumerate(items) if it.group == "long"]
    sampled = random.Random(args.seed).sample(longs, min(args.hf_long_sample, len(longs)))
    service: dict[int, float] = {}
    for i, it in enumerate(items):
        if it.group == "short" or i in sampled:
            service[i] = hf_baseline.run_batch(model, [it], pad, args.device)
    long_mean = sum(service[i] for i in sampled) / len(sampled) if sampled else 0.0
    for i in longs:
        service.setdefault(i, long_mean)
    del model
    free_at = 0.0
    e2e = {}
    for i in sorted(range(len(items)), key=lambda k: (arrivals[k], k)):
        start = max(arrivals[i], free_at)
        free_at = start + service[i]
        e2e[i] = free_at - arrivals[i]
    short = [i for i, it in enumerate(items) if it.group == "short"]
    long_span = max(arrivals[i] + e2e[i] for i in longs) - min(arrivals[i] for i in longs) if longs else 0.0
    return {
        "short": {"e2e_s": summary(e2e[i] for i in short), "requests": len(short)},
        "long": {"tokens_per_s": sum(items[i].max_tokens for i in longs) / long_span if long_span else 0.0, "seconds": long_span, "requests": len(longs)},
        "long_service_sampled": len(sampled),
        "service_seconds_total": sum(service.values()),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = report.parser(__doc__, quick_help="1 long job of 256+64 tokens, 4 short ones, no HF")
    ap.add_argument("--num-long", type=int, default=3)
    ap.add_argument("--num-short", type=int, default=24)
    ap.add_argument("--long-prompt", type=int, default=0, help="cut long prompts to this many tokens (0: the workload's 1024)")
    ap.add_argument("--long-max-tokens", type=int, default=0, help="long jobs' output tokens (0: the workload's 384)")
    ap.add_argument("--short-rate", type=float, default=1.0, help="short-job arrivals per second")
    ap.add_argument("--short-start", type=float, default=0.5, help="first short arrival, seconds after the longs")
    ap.add_argument("--kv-memory-mib", type=float, default=256)
    ap.add_argument("--hf", dest="hf", action="store_true", default=True, help="run the HF one-at-a-time FCFS baseline (default; --quick turns it off)")
    ap.add_argument("--no-hf", dest="hf", action="store_false")
    ap.add_argument("--hf-long-sample", type=int, default=1, help="long jobs HF runs (their mean stands for the rest)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    if args.quick:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(num_long=1, num_short=4, short_rate=4.0, hf=False, long_prompt=256, long_max_tokens=64)
        args = ap.parse_args(argv)

    tok = AutoTokenizer.from_pretrained(args.model)
    items = workloads.head_of_line(tok, num_long=args.num_long, num_short=args.num_short, seed=args.seed)
    for it in items:
        if it.group == "long":
            it.prompt_ids = it.prompt_ids[: args.long_prompt or None]
            it.max_tokens = args.long_max_tokens or it.max_tokens
    n_short = sum(it.group == "short" for it in items)
    short_arr = iter(drive.steady(n_short, args.short_rate, args.short_start))
    arrivals = [0.0 if it.group == "long" else next(short_arr) for it in items]
    jobs = drive.jobs_for(items, arrivals)

    result = report.meta(args.device)
    result["workload"] = {
        "long": {"requests": sum(it.group == "long" for it in items), "prompt_tokens": [len(it.prompt_ids) for it in items if it.group == "long"][:1], "max_tokens": [it.max_tokens for it in items if it.group == "long"][:1]},
        "short": {"requests": n_short, "prompt_tokens": sum(len(it.prompt_ids) for it in items if it.group == "short"), "output_tokens": sum(it.max_tokens for it in items if it.group == "short")},
        "arrivals": f"longs at 0 s; shorts steady at {args.short_rate:g}/s from {args.short_start:g} s",
    }
    runs = {}
    print("engine: mixed ...", flush=True)
    runs["mixed"] = run_engine(args, jobs)
    print("engine: shorts alone ...", flush=True)
    runs["shorts_alone"] = run_engine(args, [j for j in jobs if j.item.group == "short"])
    print("engine: longs alone ...", flush=True)
    runs["longs_alone"] = run_engine(args, [j for j in jobs if j.item.group == "long"])
    result["dtype"] = runs["mixed"]["dtype"]
    result["engine"] = runs
    if args.hf:
        print("hf: one at a time, FCFS (service times measured, queue replayed) ...", flush=True)
        result["hf_one_at_a_time_fcfs"] = hf_fcfs(args, tok, items, arrivals, _torch_dtype(result["dtype"]))
    m, s, lo = runs["mixed"], runs["shorts_alone"], runs["longs_alone"]
    result["compare"] = {
        "short_e2e_p50_mixed_over_alone": m["short"]["e2e_s"]["p50"] / s["short"]["e2e_s"]["p50"],
        "short_e2e_p99_mixed_over_alone": m["short"]["e2e_s"]["p99"] / s["short"]["e2e_s"]["p99"],
        "long_throughput_mixed_over_alone": m["long"]["tokens_per_s"] / lo["long"]["tokens_per_s"],
    }
    report.publish(result, "fairness", args.out, plot, markdown)
    return result


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name.replace("torch.", ""))


def markdown(r: dict) -> str:
    w = r["workload"]
    lines = [
        report.header(r),
        "",
        f"head-of-line: {w['long']['requests']} long jobs ({w['long']['prompt_tokens'][0]}-token prompts, {w['long']['max_tokens'][0]} output tokens), "
        f"{w['short']['requests']} short jobs ({w['short']['prompt_tokens']} prompt / {w['short']['output_tokens']} output tokens in all); {w['arrivals']}",
        "",
    ]
    rows = []
    for name, key in (("engine, mixed", "mixed"), ("engine, shorts alone", "shorts_alone")):
        x = r["engine"][key]["short"]
        rows.append([name, x["ttft_s"]["p50"], x["ttft_s"]["p99"], x["e2e_s"]["p50"], x["e2e_s"]["p99"]])
    if "hf_one_at_a_time_fcfs" in r:
        x = r["hf_one_at_a_time_fcfs"]["short"]
        rows.append(["HF one at a time, FCFS (replayed)", "-", "-", x["e2e_s"]["p50"], x["e2e_s"]["p99"]])
    lines.append("short jobs:\n")
    lines.append(report.table(["system", "TTFT p50 s", "TTFT p99 s", "e2e p50 s", "e2e p99 s"], rows))
    rows = []
    for name, key in (("engine, mixed", "mixed"), ("engine, longs alone", "longs_alone")):
        x = r["engine"][key]["long"]
        rows.append([name, x["tokens_per_s"], x["seconds"], x["ttft_s"]["p50"], x["e2e_s"]["max"]])
    if "hf_one_at_a_time_fcfs" in r:
        x = r["hf_one_at_a_time_fcfs"]["long"]
        rows.append(["HF one at a time, FCFS (replayed)", x["tokens_per_s"], x["seconds"], "-", "-"])
    lines += ["", "long jobs:\n", report.table(["system", "output tokens/s", "seconds", "TTFT p50 s", "e2e max s"], rows)]
    c = r["compare"]
    lines += [
        "",
        f"short e2e mixed/alone: p50 {c['short_e2e_p50_mixed_over_alone']:.2f}x, p99 {c['short_e2e_p99_mixed_over_alone']:.2f}x; "
        f"long throughput mixed/alone: {c['long_throughput_mixed_over_alone']:.2f}x",
    ]
    return "\n".join(lines)


def plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    for key, color in (("mixed", "tab:green"), ("shorts_alone", "tab:blue")):
        pr = [p for p in r["engine"][key]["per_request"] if p["group"] == "short"]
        ax.plot([p["arrival"] for p in pr], [p["e2e"] for p in pr], "o-", ms=3, color=color, label=f"engine, {key.replace('_', ' ')}")
    ax.set_xlabel("short job arrival (s)")
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_title("short jobs behind long ones", fontsize=9)
    ax.legend(fontsize=7)
    labels, vals = ["engine\nmixed", "engine\nshorts alone"], [r["engine"]["mixed"]["short"]["e2e_s"]["p99"], r["engine"]["shorts_alone"]["short"]["e2e_s"]["p99"]]
    if "hf_one_at_a_time_fcfs" in r:
        labels.append("HF one at a time\nFCFS")
        vals.append(r["hf_one_at_a_time_fcfs"]["short"]["e2e_s"]["p99"])
    report.bars(axes[1], labels, vals, "seconds", "short jobs: e2e p99", highlight=(0,))
    axes[1].set_yscale("log")
    labels, vals = ["engine\nmixed", "engine\nlongs alone"], [r["engine"]["mixed"]["long"]["tokens_per_s"], r["engine"]["longs_alone"]["long"]["tokens_per_s"]]
    if "hf_one_at_a_time_fcfs" in r:
        labels.append("HF one at a time\nFCFS")
        vals.append(r["hf_one_at_a_time_fcfs"]["long"]["tokens_per_s"])
    report.bars(axes[2], labels, vals, "output tokens/s", "long jobs: throughput", highlight=(0,))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    report.run_threaded(main)  # the engine runs in its own thread, as in the worker
