"""Offline throughput: the engine and HF transformers on the same workload, in one process run.

    python bench/throughput.py --model models/smollm2-135m

Workload: 128 requests, prompts 16-256 tokens, outputs 32-256 tokens (EOS ignored), drawn with a
fixed seed from licence texts. The engine runs it twice: with ``--kv-memory-mib`` of KV (default
1 GiB, about what HF's padded static batches of 32 use for this workload), compared with HF one
request at a time and with static padded batches of 16 and 32; and within ``--budget-kv-mib``
(default 256 MiB), compared with HF static batches sized to that same budget with per-request
prompt+max_tokens reservations. Also: the decode step against the matmul-only ceiling, and KV
utilisation. HF baselines run on a random sample of requests/batches (each sample's rate stands
for the whole; the sample sizes are flags).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import hf_baseline, workloads  # noqa: E402
from bench.ceiling import decode_vs_ceiling  # noqa: E402
from qworker.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from qworker.model.kv_cache import bytes_per_block  # noqa: E402

MiB = 1 << 20


def run_engine(engine: LLMEngine, items: list[workloads.Item]) -> dict:
    for i, it in enumerate(items):
        engine.add_request(f"bench-{i}", it.prompt_ids, SamplingParams(temperature=0, max_tokens=it.max_tokens, ignore_eos=True, n=it.n))
    peak_blocks = 0
    peak_running = 0
    util_num = util_den = 0
    timeline = []
    _sync(engine)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        s = engine.stats()
        peak_blocks = max(peak_blocks, s["kv_blocks_used"])
        peak_running = max(peak_running, s["num_running"])
        running = engine.scheduler.running
        util_num += sum(q.num_computed_tokens for q in running)
        util_den += sum(len(q.block_table) for q in running) * engine.kv.block_size
        timeline.append((time.perf_counter() - start, s["kv_blocks_used"], s["num_running"]))
    _sync(engine)
    seconds = time.perf_counter() - start
    useful = sum(it.max_tokens * it.n for it in items)
    return {
        "seconds": seconds,
        "tokens_per_s": useful / seconds,
        "requests_per_s": len(items) / seconds,
        "useful_tokens": useful,
        "peak_kv_blocks": peak_blocks,
        "kv_blocks_total": engine.kv.pool.num_blocks,
        "peak_running": peak_running,
        "kv_slot_utilization": util_num / util_den if util_den else 1.0,
        "preemptions": engine.stats()["preemptions_swap"] + engine.stats()["preemptions_recompute"],
        "timeline": timeline,
    }


def _kv_memory(run: dict, items: list[workloads.Item], engine: LLMEngine) -> dict:
    """What the peak batch took paged, against contiguous per-request reservations."""
    per_token = engine.runner.block_bytes(1)
    peak = items[: run["peak_running"]]
    return {
        "paged_peak_mib": run["peak_kv_blocks"] * engine.runner.block_bytes(engine.kv.block_size) / MiB,
        "reserve_prompt_plus_max_tokens_mib": sum(len(i.prompt_ids) + i.max_tokens for i in peak) * per_token / MiB,
        "reserve_max_model_len_mib": run["peak_running"] * engine.max_model_len * per_token / MiB,
    }


def _sync(engine: LLMEngine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--max-output", type=int, default=256, help="outputs are drawn from [min(32, this), this] tokens")
    ap.add_argument("--kv-memory-mib", type=int, default=1024, help="KV memory of the main engine run")
    ap.add_argument("--budget-kv-mib", type=int, default=256, help="KV budget shared by the engine and the same-budget HF baseline; 0 skips")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engine's KV cache dtype (auto = the model's)")
    ap.add_argument("--hf-single-sample", type=int, default=16, help="requests run one at a time by HF")
    ap.add_argument("--hf-batch-sample", type=int, default=1, help="static batches run per HF batch baseline")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--decode-batches", default="16,32,64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--random-weights", action="store_true", help="time with random weights when the model folder has none")
    args = ap.parse_args(argv)
    if args.random_weights and not any(Path(args.model).glob("*.safetensors")):
        from bench.random_model import random_weight_copy

        args.model = random_weight_copy(args.model)

    def new_engine(kv_mib: int, **kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                      kv_cache_memory=kv_mib * MiB, max_num_seqs=256, **kw))

    engine = new_engine(args.kv_memory_mib)
    tok = engine.tokenizer
    items = workloads.mixed(tok, num=args.num_requests, seed=args.seed, output_range=(min(32, args.max_output), args.max_output))

    def measure(engine: LLMEngine, kv_mib: int) -> tuple[dict, list]:
        """A warm-up, then the workload: the run's figures and its KV timeline."""
        run_engine(engine, workloads.mixed(tok, num=4, seed=args.seed + 1, output_range=(4, 8)))
        print(f"engine: {len(items)} requests, {kv_mib} MiB KV ...", flush=True)
        run = run_engine(engine, items)
        timeline = run.pop("timeline")
        return {**run, "kv_memory_mib": kv_mib, **_kv_memory(run, items, engine)}, timeline

    result: dict = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, {platform.processor() or platform.platform()}",
        "device": str(engine.runner.device),
        "dtype": str(engine.runner.dtype),
        "kv_cache_dtype": str(engine.runner.kv_dtype),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "workload": {"requests": len(items), "prompt_tokens": sum(len(i.prompt_ids) for i in items), "useful_output_tokens": sum(i.max_tokens for i in items)},
    }
    bytes_per_token = engine.runner.block_bytes(1)
    m = engine.runner.model
    # HF's cache holds K/V in the model's dtype, whatever the engine's KV dtype
    hf_bytes_per_token = bytes_per_block(m.num_layers, 1, m.num_kv_heads, m.head_dim, engine.runner.dtype)
    eng, timeline = measure(engine, args.kv_memory_mib)
    result["engine"] = eng
    del engine
    if args.budget_kv_mib:
        result["engine_kv_budget"], _ = measure(new_engine(args.budget_kv_mib), args.budget_kv_mib)

    result["decode_vs_ceiling"] = []
    batches = [int(x) for x in args.decode_batches.split(",") if x]
    if batches:
        # its own engine, with KV room for the largest batch: a decode-speed probe must not preempt
        context = 160
        probe = new_engine(max(-(-max(batches) * (context + 32) * bytes_per_token // MiB), 1), swap_space=0)
    for b in batches:
        row = decode_vs_ceiling(probe, b, context=context)
        result["decode_vs_ceiling"].append(row)
        print(f"decode batch {b}: {row['decode_tokens_per_s']:.1f} tok/s vs ceiling {row['matmul_ceiling_tokens_per_s']:.1f} ({row['fraction']:.0%})", flush=True)
    if batches:
        del probe

    if not args.skip_hf:
        rng = random.Random(args.seed)
        model = hf_baseline.load_hf(args.model, args.device, m.dtype)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        base = {}
        print("hf: one at a time ...", flush=True)
        single = rng.sample(items, min(args.hf_single_sample, len(items)))
        base["hf_one_at_a_time"] = hf_baseline.useful_rate(model, [[it] for it in single], pad, args.device)
        for size in (16, 32):
            print(f"hf: static batches of {size} ...", flush=True)
            batches = rng.sample(hf_baseline.batches_of(items, size), args.hf_batch_sample)
            base[f"hf_static_batch_{size}"] = hf_baseline.useful_rate(model, batches, pad, args.device)
        for v in base.values():
            v["engine_ratio"] = eng["tokens_per_s"] / v["tokens_per_s"]
        if args.budget_kv_mib:
            budget_batches = hf_baseline.batches_within_budget(items, args.budget_kv_mib * MiB // hf_bytes_per_token)
            print(f"hf: static batches within {args.budget_kv_mib} MiB ({len(budget_batches)} batches, sizes {[len(b) for b in budget_batches][:6]}...) ...", flush=True)
            same = hf_baseline.useful_rate(model, rng.sample(budget_batches, args.hf_batch_sample), pad, args.device)
            same["mean_batch_size"] = sum(len(b) for b in budget_batches) / len(budget_batches)
            same["engine_ratio"] = result["engine_kv_budget"]["tokens_per_s"] / same["tokens_per_s"]
            base["hf_static_same_kv_budget"] = same
        result["baselines"] = base

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"throughput-{result['device'].split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}"
    (out_dir / f"{stem}.json").write_text(json.dumps(result, indent=2))
    _plot(out_dir / f"{stem}.png", result, timeline)
    print(markdown(result))
    print(f"\nfull figures: {out_dir / (stem + '.json')}")
    return result


def markdown(r: dict) -> str:
    e = r["engine"]
    b = r.get("engine_kv_budget")
    lines = [
        f"{r['date']}, commit {r['commit']}, {r['device']} {r['dtype']} (KV {r.get('kv_cache_dtype', r['dtype'])}), {r['machine']}",
        "",
        "| system | KV memory | useful tokens/s | requests/s | engine ratio |",
        "|---|---:|---:|---:|---:|",
        f"| qworker engine | {e['kv_memory_mib']} MiB | {e['tokens_per_s']:.1f} | {e['requests_per_s']:.3f} | 1.00 |",
    ]
    if b:
        lines.append(f"| qworker engine | {b['kv_memory_mib']} MiB | {b['tokens_per_s']:.1f} | {b['requests_per_s']:.3f} | |")
    for name, v in r.get("baselines", {}).items():
        budget = f"{b['kv_memory_mib']} MiB" if name == "hf_static_same_kv_budget" else "as needed"
        lines.append(f"| {name} | {budget} | {v['tokens_per_s']:.1f} | {v['requests_per_s']:.3f} | {v['engine_ratio']:.2f}x |")
    lines += ["", "| decode batch | engine tokens/s | matmul ceiling | fraction |", "|---:|---:|---:|---:|"]
    for d in r["decode_vs_ceiling"]:
        lines.append(f"| {d['batch']} | {d['decode_tokens_per_s']:.1f} | {d['matmul_ceiling_tokens_per_s']:.1f} | {d['fraction']:.0%} |")
    for run in (e, b):
        if run:
            lines += [
                "",
                f"KV ({run['kv_memory_mib']} MiB run): peak {run['peak_kv_blocks']}/{run['kv_blocks_total']} blocks ({run['paged_peak_mib']:.0f} MiB) for up to {run['peak_running']} running requests; "
                f"slot utilisation {run['kv_slot_utilization']:.1%}; contiguous reservations for the same batch would need "
                f"{run['reserve_prompt_plus_max_tokens_mib']:.0f} MiB (prompt+max_tokens) or {run['reserve_max_model_len_mib']:.0f} MiB (max_model_len); "
                f"preemptions {run['preemptions']}",
            ]
    return "\n".join(lines)


def _plot(path: Path, r: dict, timeline) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    engines = [r["engine"]] + ([r["engine_kv_budget"]] if "engine_kv_budget" in r else [])
    names = [f"engine {e['kv_memory_mib']} MiB" for e in engines] + list(r.get("baselines", {}))
    rates = [e["tokens_per_s"] for e in engines] + [v["tokens_per_s"] for v in r.get("baselines", {}).values()]
    ax1.bar(range(len(names)), rates, color=["tab:green"] * len(engines) + ["tab:gray"] * (len(names) - len(engines)))
    ax1.set_xticks(range(len(names)), [n.replace("hf_", "hf\n").replace("_", " ") for n in names], fontsize=7)
    ax1.set_ylabel("useful output tokens/s")
    ax1.set_title("mixed workload, offline")
    if timeline:
        t, blocks, running = zip(*timeline)
        ax2.plot(t, [b / r["engine"]["kv_blocks_total"] for b in blocks], label="KV blocks used (fraction)")
        ax2.plot(t, [x / max(running) for x in running], label="running requests (fraction of peak)")
        ax2.set_xlabel("seconds")
        ax2.legend(fontsize=7)
        ax2.set_title(f"KV usage over time ({r['engine']['kv_memory_mib']} MiB run)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
