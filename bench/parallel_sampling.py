"""Parallel sampling: n = 4 choices per prompt (copy-on-write sharing) vs 4 independent requests.

    python bench/parallel_sampling.py [--quick]

Workload (bench/workloads.py ``parallel_sampling``): prompts of 32-160 tokens, 32-96 output tokens,
``n`` = 4, all arriving at once, EOS ignored, sampling at temperature 0.8 (every run). Engine runs in one
process:

* ``n=4``: one request per prompt; after its prompt the sequence forks into 4 that share every
  prompt block and copy a block only when they write into a shared one;
* 4 independent requests per prompt, prefix caching on (the copies find the prompt in the cache);
* 4 independent requests per prompt, prefix caching off (each copy computes and stores the prompt).

And HF transformers ``generate(num_return_sequences=4, do_sample=True)`` on static padded batches
of prompts (a sample of batches; its rate stands for the whole).

Reports useful output tokens/s (every choice's tokens count), copy-on-write copies, prompt tokens
computed, and KV blocks used (peak and mean over the run).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import drive, hf_baseline, report, workloads  # noqa: E402


def run_engine(args, items, caching: bool = True) -> dict:
    engine = drive.new_engine(args.model, args.device, args.dtype, args.kv_memory_mib, enable_prefix_caching=caching, max_num_seqs=256)
    drive.warm_up(engine)
    run = drive.drive(engine, drive.jobs_for(items, temperature=0.8))
    c = run.counters
    tl = run.timeline
    out = {
        **run.summary(),
        "useful_tokens": run.useful_tokens(),
        "cow_copies": c["cow_copies"],
        "prompt_tokens_computed": c["prompt_tokens_computed"],
        "prompt_tokens_cached": c["prompt_tokens_cached"],
        "forward_tokens": c["forward_tokens"],
        "peak_kv_blocks": run.peak["kv_blocks_used"],
        "mean_kv_blocks": sum(p["kv_blocks_used"] for p in tl) / len(tl) if tl else 0.0,
        "kv_blocks_total": c["kv_blocks_total"],
        "peak_running": run.peak["num_running"],
        "preemptions": c["preemptions_swap"] + c["preemptions_recompute"],
        "timeline": tl,
        "dtype": str(engine.runner.dtype),
    }
    del engine
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = report.parser(__doc__, quick_help="3 prompts, 8 output tokens, no HF")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=0, help="override every output length (0: the workload's 32-96)")
    ap.add_argument("--kv-memory-mib", type=float, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=8, help="prompts per HF static batch (x n sequences)")
    ap.add_argument("--hf-batch-sample", type=int, default=1, help="HF static batches run (0: skip HF)")
    args = ap.parse_args(argv)
    if args.quick:  # smaller defaults; flags given explicitly still win
        ap.set_defaults(num_prompts=3, hf_batch_sample=0, max_tokens=8)
        args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    items = workloads.parallel_sampling(tok, num=args.num_prompts, n=args.n, seed=args.seed)
    if args.max_tokens:
        for it in items:
            it.max_tokens = args.max_tokens
    singles = [workloads.Item(it.prompt_ids, it.max_tokens, 1, it.group) for it in items for _ in range(it.n)]
    result = report.meta(args.device)
    result["workload"] = {
        "prompts": len(items),
        "n": args.n,
        "prompt_tokens": sum(len(i.prompt_ids) for i in items),
        "useful_output_tokens": sum(i.max_tokens * i.n for i in items),
    }
    runs = {}
    print(f"engine: {len(items)} requests with n={args.n} ...", flush=True)
    runs["n4"] = run_engine(args, items)
    print(f"engine: {len(singles)} independent requests, prefix caching on ...", flush=True)
    runs["independent_cached"] = run_engine(args, singles, caching=True)
    print(f"engine: {len(singles)} independent requests, prefix caching off ...", flush=True)
    runs["independent_uncached"] = run_engine(args, singles, caching=False)
    result["dtype"] = runs["n4"]["dtype"]
    result["engine"] = runs
    base = {}
    if args.hf_batch_sample:
        from transformers import AutoConfig  # noqa: F401  (HF import cost stays out of the engine runs)

        model = hf_baseline.load_hf(args.model, args.device, _torch_dtype(result["dtype"]))
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        batches = random.Random(args.seed).sample(hf_baseline.batches_of(items, args.hf_batch_size), args.hf_batch_sample)
        print(f"hf: generate(num_return_sequences={args.n}) on {len(batches)} static batch(es) of {args.hf_batch_size} prompts ...", flush=True)
        base[f"hf_static_batch_{args.hf_batch_size}x{args.n}"] = hf_baseline.useful_rate(model, batches, pad, args.device)
        del model
    for v in base.values():
        v["engine_ratio"] = runs["n4"]["tokens_per_s"] / v["tokens_per_s"]
    result["baselines"] = base
    ind = runs["independent_uncached"]
    result["compare"] = {
        "throughput_n4_vs_independent_cached": runs["n4"]["tokens_per_s"] / runs["independent_cached"]["tokens_per_s"],
        "throughput_n4_vs_independent_uncached": runs["n4"]["tokens_per_s"] / ind["tokens_per_s"],
        "peak_kv_blocks_n4_vs_independent_uncached": runs["n4"]["peak_kv_blocks"] / max(ind["peak_kv_blocks"], 1),
        "mean_kv_blocks_n4_vs_independent_uncached": runs["n4"]["mean_kv_blocks"] / max(ind["mean_kv_blocks"], 1e-9),
    }
    report.publish(result, "parallel_sampling", args.out, plot, markdown)
    return result


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name.replace("torch.", ""))


LABELS = {"n4": "engine, n=4", "independent_cached": "engine, 4 independent, prefix cache", "independent_uncached": "engine, 4 independent, no prefix cache"}


def markdown(r: dict) -> str:
    w = r["workload"]
    lines = [
        report.header(r),
        "",
        f"parallel sampling: {w['prompts']} prompts x n={w['n']}, {w['prompt_tokens']} prompt tokens, {w['useful_output_tokens']} useful output tokens",
        "",
    ]
    rows = []
    for k, x in r["engine"].items():
        rows.append([LABELS[k], x["tokens_per_s"], x["seconds"], x["cow_copies"], x["prompt_tokens_computed"], x["peak_kv_blocks"], x["mean_kv_blocks"], x["preemptions"]])
    for k, v in r["baselines"].items():
        rows.append([f"{k} (sample of {v['batches']} batch)", v["tokens_per_s"], v["seconds"], "-", "-", "-", "-", "-"])
    lines.append(report.table(["system", "useful tokens/s", "seconds", "CoW copies", "prompt tokens computed", "peak KV blocks", "mean KV blocks", "preemptions"], rows))
    c = r["compare"]
    lines += [
        "",
        f"n=4 vs 4 independent: throughput {c['throughput_n4_vs_independent_cached']:.2f}x (prefix cache on) / {c['throughput_n4_vs_independent_uncached']:.2f}x (off); "
        f"KV blocks {c['peak_kv_blocks_n4_vs_independent_uncached']:.2f}x peak, {c['mean_kv_blocks_n4_vs_independent_uncached']:.2f}x mean of the uncached run",
    ]
    for k, v in r["baselines"].items():
        lines.append(f"engine n=4 / {k}: {v['engine_ratio']:.2f}x")
    return "\n".join(lines)


def plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    short = {"n4": "engine\nn=4", "independent_cached": "engine 4 indep.\nprefix cache", "independent_uncached": "engine 4 indep.\nno cache"}
    names = [short[k] for k in r["engine"]] + [k.replace("hf_", "hf\n").replace("_", " ") for k in r["baselines"]]
    vals = [x["tokens_per_s"] for x in r["engine"].values()] + [v["tokens_per_s"] for v in r["baselines"].values()]
    report.bars(axes[0], names, vals, "useful output tokens/s", "parallel sampling throughput", highlight=(0,))
    report.bars(axes[1], [short[k] for k in r["engine"]], [x["peak_kv_blocks"] for x in r["engine"].values()], "KV blocks", "peak KV blocks used", highlight=(0,))
    total = r["engine"]["n4"]["kv_blocks_total"]
    report.kv_timeline(axes[2], {short[k].replace("\n", " "): x["timeline"] for k, x in r["engine"].items()}, total)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    report.run_threaded(main)  # the engine runs in its own thread, as in the worker
