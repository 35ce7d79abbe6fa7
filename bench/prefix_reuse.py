"""Prefix reuse: the shared-prefix workload with prefix caching on and off, in one process run.

    python bench/prefix_reuse.py [--quick]

Workload (bench/workloads.py ``shared_prefix``): groups of requests sharing a long system prompt,
each with a short distinct question, shuffled. Two arrival patterns, each with caching on and off:

* burst: everything at once (total prompt work and makespan; TTFT then is mostly queueing);
* steady: evenly spaced arrivals at ``--rate`` per second, the engine stepped as they come
  (bench/drive.py). TTFT depends on the arrival pattern, so the rate is fixed and reported; by
  default (``auto``) it is half the requests/s the engine sustains *without* caching in the burst
  run, so the baseline is not overloaded and TTFT is not just queueing.

Reports prompt tokens computed vs served from the prefix cache, the share of the *shared* prompt
tokens served from cache (of all of them, and of those a cache could ever serve: every request
but the first of its group), and TTFT mean / p50 / p90 / p99 with caching on and off.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import drive, report, workloads  # noqa: E402


def run_one(args, caching: bool, items, arrivals) -> dict:
    engine = drive.new_engine(args.model, args.device, args.dtype, args.kv_memory_mib, enable_prefix_caching=caching, max_num_seqs=256)
    drive.warm_up(engine)
    run = drive.drive(engine, drive.jobs_for(items, arrivals))
    out = {"caching": caching, **run.summary(), "counters": run.counters, "peak": run.peak, "timeline": run.timeline}
    out["per_request"] = [{k: r[k] for k in ("id", "group", "ttft", "e2e", "cached_tokens")} for r in run.requests]
    out["dtype"] = str(engine.runner.dtype)
    out["block_size"] = engine.kv.block_size
    del engine
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = report.parser(__doc__, quick_help="2 groups of 3, 128-token prefix, 4 output tokens")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=6)
    ap.add_argument("--prefix-len", type=int, default=384)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rate", default="auto", help="steady arrivals per second, or 'auto': half the requests/s the engine sustains without caching (measured by the burst run)")
    ap.add_argument("--no-burst", dest="burst", action="store_false", help="skip the all-at-once scenario (needs a numeric --rate)")
    ap.add_argument("--kv-memory-mib", type=float, default=256)
    args = ap.parse_args(argv)
    if args.quick:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(groups=2, per_group=3, prefix_len=128, max_tokens=4)
        args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    items = workloads.shared_prefix(tok, groups=args.groups, per_group=args.per_group, prefix_len=args.prefix_len, seed=args.seed, max_tokens=args.max_tokens)
    shared = len(items) * args.prefix_len
    reusable = (len(items) - args.groups) * args.prefix_len
    result = report.meta(args.device)
    result["workload"] = {
        "requests": len(items),
        "groups": args.groups,
        "prefix_len": args.prefix_len,
        "prompt_tokens": sum(len(i.prompt_ids) for i in items),
        "shared_prompt_tokens": shared,
        "reusable_shared_tokens": reusable,
        "max_tokens": args.max_tokens,
    }
    result["scenarios"] = {}
    names = (["burst"] if args.burst or args.rate == "auto" else []) + ["steady"]
    for name in names:
        arrivals = None
        if name == "steady":
            if args.rate == "auto":  # half of what the engine without caching sustains (burst run)
                off = result["scenarios"]["burst"]["off"]
                args.rate = float(f"{0.5 * off['requests_per_s']:.3g}")
            arrivals = drive.steady(len(items), float(args.rate))
        runs = {}
        for caching in (True, False):
            print(f"{name}: prefix caching {'on' if caching else 'off'} ...", flush=True)
            runs["on" if caching else "off"] = run_one(args, caching, items, arrivals)
        on, off = runs["on"], runs["off"]
        cached = on["counters"]["prompt_tokens_cached"]
        runs["compare"] = {
            "arrival": f"steady, {float(args.rate):g} requests/s" if arrivals else "all at once",
            "shared_tokens_from_cache": cached / shared,
            "reusable_shared_tokens_from_cache": cached / reusable if reusable else float("nan"),
            "prompt_tokens_computed_ratio": off["counters"]["prompt_tokens_computed"] / max(on["counters"]["prompt_tokens_computed"], 1),
            "mean_ttft_ratio": off["ttft_s"]["mean"] / on["ttft_s"]["mean"],
            "p50_ttft_ratio": off["ttft_s"]["p50"] / on["ttft_s"]["p50"],
            "makespan_ratio": off["seconds"] / on["seconds"],
        }
        result["scenarios"][name] = runs
    result["dtype"] = result["scenarios"]["steady"]["on"]["dtype"]
    result["scenarios"] = {k: result["scenarios"][k] for k in ("steady", "burst") if k in result["scenarios"]}
    report.publish(result, "prefix_reuse", args.out, plot, markdown)
    return result


def markdown(r: dict) -> str:
    w = r["workload"]
    lines = [
        report.header(r),
        "",
        f"shared-prefix: {w['requests']} requests in {w['groups']} groups, {w['prefix_len']}-token shared prefix, "
        f"{w['prompt_tokens']} prompt tokens ({w['shared_prompt_tokens']} shared, {w['reusable_shared_tokens']} reusable), {w['max_tokens']} output tokens each",
        "",
    ]
    rows = []
    for name, runs in r["scenarios"].items():
        for key in ("on", "off"):
            x = runs[key]
            rows.append(
                [
                    f"{name} ({runs['compare']['arrival']})",
                    key,
                    x["counters"]["prompt_tokens_computed"],
                    x["counters"]["prompt_tokens_cached"],
                    x["ttft_s"]["mean"],
                    x["ttft_s"]["p50"],
                    x["ttft_s"]["p90"],
                    x["ttft_s"]["p99"],
                    x["seconds"],
                ]
            )
    lines.append(report.table(["arrivals", "prefix caching", "prompt tokens computed", "from cache", "TTFT mean s", "p50 s", "p90 s", "p99 s", "makespan s"], rows, "llrrrrrrr"))
    lines.append("")
    rows = []
    for name, runs in r["scenarios"].items():
        c = runs["compare"]
        rows.append([name, f"{c['shared_tokens_from_cache']:.1%}", f"{c['reusable_shared_tokens_from_cache']:.1%}", f"{c['prompt_tokens_computed_ratio']:.2f}x", f"{c['mean_ttft_ratio']:.2f}x", f"{c['p50_ttft_ratio']:.2f}x"])
    lines.append(report.table(["arrivals", "shared tokens from cache", "of reusable", "prompt compute off/on", "mean TTFT off/on", "p50 TTFT off/on"], rows))
    return "\n".join(lines)


def plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    steady = r["scenarios"]["steady"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    report.bars(
        axes[0],
        ["computed\ncaching on", "from cache\ncaching on", "computed\ncaching off"],
        [steady["on"]["counters"]["prompt_tokens_computed"], steady["on"]["counters"]["prompt_tokens_cached"], steady["off"]["counters"]["prompt_tokens_computed"]],
        "prompt tokens",
        "prompt tokens (steady arrivals)",
        highlight=(0, 1),
    )
    ax = axes[1]
    stats = ["mean", "p50", "p90", "p99"]
    for k, (key, color) in enumerate((("on", "tab:green"), ("off", "tab:gray"))):
        ax.bar([i + 0.4 * k for i in range(len(stats))], [steady[key]["ttft_s"][s] for s in stats], 0.4, color=color, label=f"caching {key}")
    ax.set_xticks([i + 0.2 for i in range(len(stats))], stats)
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"TTFT, {steady['compare']['arrival']}", fontsize=9)
    ax.legend(fontsize=7)
    report.kv_timeline(axes[2], {f"caching {k}": steady[k]["timeline"] for k in ("on", "off")}, steady["on"]["counters"]["kv_blocks_total"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    report.run_threaded(main)  # the engine runs in its own thread, as in the worker
