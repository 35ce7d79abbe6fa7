"""Memory pressure: the long-context workload with a KV pool too small to hold it, swap vs recompute.

    python bench/memory_pressure.py [--quick]

Workload (bench/workloads.py ``long_context``): a few requests with long prompts and long outputs,
all arriving at once, EOS ignored. The KV pool is sized to ``--kv-fraction`` of the blocks the
whole workload needs at its peak (every request's prompt + max_tokens), so all prompts fit but the
decodes outgrow the pool and the scheduler must preempt. Three engine runs in one process:

* swap on (``swap_space`` 1 GiB): preempted sequences move their KV to the CPU swap pool;
* recompute only (``swap_space=0``): preempted sequences drop their KV and prefill again;
* ample pool: the same workload with room for everything (what the pressure costs).

And HF transformers on the same workload as baselines (each on a sample, its rate standing for
the whole): one request at a time, and static batches as large as fit in the same KV memory when
each request reserves prompt + max_tokens contiguously.

Note: "long" here is ~1k tokens, not the model's 8k context: a CPU prefill runs ~400 tokens/s.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import drive, hf_baseline, report, workloads  # noqa: E402

GiB = 1 << 30


def run_engine(args, kv_mib: float, swap_space: int, items) -> dict:
    engine = drive.new_engine(args.model, args.device, args.dtype, kv_mib, swap_space=swap_space, max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens)
    drive.warm_up(engine)
    try:
        run = drive.drive(engine, drive.jobs_for(items))
    except Exception as e:  # an engine failure is a result too: record it, go on with the other runs
        import traceback

        where = traceback.extract_tb(e.__traceback__)[-1]
        print(f"  engine run failed: {type(e).__name__}: {e} ({where.filename}:{where.lineno})", flush=True)
        return {"error": f"{type(e).__name__}: {e}", "where": f"{where.filename}:{where.lineno}", "stats": engine.stats()}
    c = run.counters
    out = {
        **run.summary(),
        "kv_blocks_total": c["kv_blocks_total"],
        "cpu_swap_blocks_total": c["cpu_swap_blocks_total"],
        "preemptions_swap": c["preemptions_swap"],
        "preemptions_recompute": c["preemptions_recompute"],
        "blocks_swapped_out": c["blocks_swapped_out"],
        "blocks_swapped_in": c["blocks_swapped_in"],
        "prompt_tokens_computed": c["prompt_tokens_computed"],
        "forward_tokens": c["forward_tokens"],
        "steps": c["steps"],
        "peak": run.peak,
        "timeline": run.timeline,
        "dtype": str(engine.runner.dtype),
    }
    del engine
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = report.parser(__doc__, quick_help="4 requests of ~192 tokens, 64 output tokens, no HF")
    ap.add_argument("--num-requests", type=int, default=6)
    ap.add_argument("--context", type=int, default=1280, help="prompt + max_tokens per request (prompts a little shorter)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--kv-fraction", type=float, default=0.8, help="KV pool as a fraction of the workload's peak need")
    ap.add_argument("--swap-gib", type=float, default=1.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024, help="the engine's per-step token budget (prefill chunk)")
    ap.add_argument("--hf-single-sample", type=int, default=1, help="requests HF runs one at a time (0: skip)")
    ap.add_argument("--hf-batch-sample", type=int, default=1, help="budget-sized static batches HF runs (0: skip)")
    ap.add_argument("--no-ample", dest="ample", action="store_false", help="skip the run with an ample pool")
    args = ap.parse_args(argv)
    if args.quick:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(num_requests=4, context=192, max_tokens=64, hf_single_sample=0, hf_batch_sample=0)
        args = ap.parse_args(argv)

    probe = drive.new_engine(args.model, args.device, args.dtype, 8, swap_space=0)
    tok, bs = probe.tokenizer, probe.kv.block_size
    block_bytes = probe.runner.block_bytes(bs)
    token_bytes = probe.runner.block_bytes(1)
    hf_dtype = probe.runner.dtype
    del probe

    items = workloads.long_context(tok, num=args.num_requests, context=args.context, seed=args.seed, max_tokens=args.max_tokens)
    peak_blocks = sum(-(-(len(i.prompt_ids) + i.max_tokens) // bs) for i in items)
    pool_blocks = max(int(peak_blocks * args.kv_fraction), max(-(-(len(i.prompt_ids) + i.max_tokens) // bs) for i in items) + 2)
    kv_mib = pool_blocks * block_bytes / report.MiB
    ample_mib = (peak_blocks + 8) * block_bytes / report.MiB

    result = report.meta(args.device, str(hf_dtype))
    result["workload"] = {
        "requests": len(items),
        "prompt_tokens": sum(len(i.prompt_ids) for i in items),
        "useful_output_tokens": sum(i.max_tokens for i in items),
        "peak_need_blocks": peak_blocks,
        "pool_blocks": pool_blocks,
        "pool_mib": kv_mib,
        "block_size": bs,
    }
    runs = {}
    print(f"engine, swap on ({pool_blocks} of {peak_blocks} blocks needed) ...", flush=True)
    runs["swap"] = run_engine(args, kv_mib, int(args.swap_gib * GiB), items)
    print("engine, recompute only (swap_space=0) ...", flush=True)
    runs["recompute"] = run_engine(args, kv_mib, 0, items)
    if args.ample:
        print("engine, ample pool ...", flush=True)
        runs["ample"] = run_engine(args, ample_mib, int(args.swap_gib * GiB), items)
    result["engine"] = runs

    base = {}
    if args.hf_single_sample or args.hf_batch_sample:
        rng = random.Random(args.seed)
        model = hf_baseline.load_hf(args.model, args.device, hf_dtype)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        if args.hf_single_sample:
            print("hf: one at a time ...", flush=True)
            base["hf_one_at_a_time"] = hf_baseline.useful_rate(model, [[it] for it in rng.sample(items, min(args.hf_single_sample, len(items)))], pad, args.device)
        if args.hf_batch_sample:
            batches = hf_baseline.batches_within_budget(items, pool_blocks * bs)
            print(f"hf: static batches within the same {kv_mib:.0f} MiB (sizes {[len(b) for b in batches]}) ...", flush=True)
            base["hf_static_same_kv_budget"] = hf_baseline.useful_rate(model, rng.sample(batches, min(args.hf_batch_sample, len(batches))), pad, args.device)
            base["hf_static_same_kv_budget"]["batch_sizes"] = [len(b) for b in batches]
        del model
    nan = float("nan")
    for v in base.values():
        v["swap_ratio"] = runs["swap"].get("tokens_per_s", nan) / v["tokens_per_s"]
        v["recompute_ratio"] = runs["recompute"].get("tokens_per_s", nan) / v["tokens_per_s"]
    result["baselines"] = base
    result["swap_vs_recompute_throughput"] = runs["swap"].get("tokens_per_s", nan) / runs["recompute"].get("tokens_per_s", nan)
    result["max_num_batched_tokens"] = args.max_num_batched_tokens
    result["reservation_mib_all_at_once"] = sum(len(i.prompt_ids) + i.max_tokens for i in items) * token_bytes / report.MiB
    report.publish(result, "memory_pressure", args.out, plot, markdown)
    return result


def markdown(r: dict) -> str:
    w = r["workload"]
    lines = [
        report.header(r),
        "",
        f"long-context: {w['requests']} requests, {w['prompt_tokens']} prompt tokens, {w['useful_output_tokens']} output tokens; "
        f"KV pool {w['pool_blocks']} blocks ({report.fmt(w['pool_mib'])} MiB) for a peak need of {w['peak_need_blocks']} blocks; "
        f"{r['max_num_batched_tokens']} tokens per step",
        "",
    ]
    rows = []
    for name, x in r["engine"].items():
        if "error" in x:
            rows.append([f"engine, {name}: FAILED ({x['error']} at {x['where']})", "-", "-", x["stats"]["preemptions_swap"], x["stats"]["preemptions_recompute"], "-", "-", "-", "-"])
            continue
        rows.append(
            [
                f"engine, {name}" + (f" ({x['kv_blocks_total']} blocks)" if name == "ample" else ""),
                x["tokens_per_s"],
                x["seconds"],
                x["preemptions_swap"],
                x["preemptions_recompute"],
                f"{x['blocks_swapped_out']}/{x['blocks_swapped_in']}",
                x["forward_tokens"],
                x["e2e_s"]["p50"],
                x["e2e_s"]["max"],
            ]
        )
    for name, v in r["baselines"].items():
        extra = f" (batches {v['batch_sizes']})" if "batch_sizes" in v else ""
        rows.append([f"{name}{extra}, sample of {v['requests']}", v["tokens_per_s"], v["seconds"], "-", "-", "-", "-", "-", "-"])
    lines.append(report.table(["system", "useful tokens/s", "seconds", "preempt swap", "preempt recompute", "blocks out/in", "tokens through model", "e2e p50 s", "e2e max s"], rows))
    lines.append("")
    lines.append(f"swap on / recompute only throughput: {r['swap_vs_recompute_throughput']:.2f}x")
    for name, v in r["baselines"].items():
        lines.append(f"engine (swap) / {name}: {v['swap_ratio']:.2f}x; engine (recompute) / {name}: {v['recompute_ratio']:.2f}x")
    return "\n".join(lines)


def plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ok = {k: x for k, x in r["engine"].items() if "error" not in x}
    names = [f"engine\n{k}" for k in ok] + [n.replace("hf_", "hf\n").replace("_", " ") for n in r["baselines"]]
    vals = [x["tokens_per_s"] for x in ok.values()] + [v["tokens_per_s"] for v in r["baselines"].values()]
    report.bars(axes[0], names, vals, "useful output tokens/s", "long-context under KV pressure", highlight=range(len(ok)))
    total = r["workload"]["pool_blocks"]
    report.kv_timeline(axes[1], {k: ok[k]["timeline"] for k in ("swap", "recompute") if k in ok}, total, "KV pool in use (pressured pool)")
    ax = axes[2]
    for k in ("swap", "recompute"):
        if k not in ok:
            continue
        tl = ok[k]["timeline"]
        ax.plot([p["t"] for p in tl], [p["num_running"] for p in tl], label=f"{k}: running", lw=1)
    tl = ok.get("swap", {}).get("timeline", [])
    ax.plot([p["t"] for p in tl], [p["num_swapped"] for p in tl], label="swap: swapped out", lw=1, ls="--")
    ax.set_xlabel("seconds")
    ax.set_ylabel("sequences")
    ax.set_title("running / swapped sequences", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    report.run_threaded(main)  # the engine runs in its own thread, as in the worker
