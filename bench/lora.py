"""Multi-LoRA throughput: 1, 4 and 16 rank-16 adapters mixed evenly in one workload, against the
base model alone, in the same run.

    python bench/lora.py                  # 64 requests, 3 rounds
    python bench/lora.py --quick          # 32 requests, 2 rounds

Adapters: random PEFT adapters made with ``peft`` against ``--model`` (all of q, k, v, o, gate,
up, down; rank 16, alpha 16; B drawn non-zero so the outputs really move), saved once under
``<out>/lora-adapters/`` and reused by later runs. Workload: ``--requests`` prompts of 16-128
tokens of licence text, 24-40 output tokens each (EOS ignored, greedy); with ``k`` adapters
request ``i`` runs under adapter ``i % k`` (evenly mixed: every step holds up to ``k`` of them).

Modes, each one ``LLM.generate`` of the whole workload (prefill included, prefix caching off in
both engines: every run repeats the same prompts, which the base engine alone would otherwise serve
from its cache), tokens/s = output tokens / wall seconds:

* ``base``: an engine without LoRA (``enable_lora=False``): the reference every ratio divides by;
* ``base, LoRA engine``: the LoRA engine with no adapter on any request (what enabling LoRA costs
  requests that use none);
* ``k adapters``: the LoRA engine (``max_loras = max_cpu_loras = --max-loras``, rank 16), every
  request under one of ``k`` adapters.

Both engines are built once and warmed up by one untimed run of the workload each (the LoRA
engine's under every adapter, each loaded once: the figures are the steady state of a pod whose
adapters are resident, not adapter loading). The modes take
turns within each round in an order that rotates per round, so a drift in machine load hits all
alike; the figures are the median over rounds, and each ratio is the median over rounds of the
mode's tokens/s over the base run of the same round (this shared machine's load moves absolute
figures more than it moves those ratios). Each run's CPU time (``time.process_time``, every
thread of this process) is recorded too: output tokens per CPU-second and its ratio do not
count the time other processes take from this one, the steadier figure on a loaded machine
(with ``--threads 1`` above all: a 2-thread GEMM whose partner thread is preempted spins or waits
at its barrier, and that time is counted). Also recorded: the share of adapter requests whose
output differs from the same prompt's base output (zero would mean the adapters did nothing).
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import report, workloads  # noqa: E402

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BASE, BASE_LORA_ENGINE = "base", "base, LoRA engine"


def _make_adapter(model_dir: str, out_dir: Path, rank: int, seed: int) -> Path:
    """A random PEFT adapter on every projection: the tests' helper when it is there (the same
    adapters the parity tests check), else the same recipe here (PEFT's A, B = randn * 0.05)."""
    try:
        from tests.engine.lora_support import make_peft_adapter
    except ImportError:
        make_peft_adapter = None
    if make_peft_adapter is not None:
        return make_peft_adapter(model_dir, out_dir, rank=rank, target_modules=ALL_MODULES, seed=seed, alpha=16)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=16, target_modules=ALL_MODULES, lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


def make_adapters(model_dir: str, out: Path, count: int, rank: int, seed: int) -> list[Path]:
    """``count`` adapters for ``model_dir``, cached under ``out`` (keyed by the model's config and
    weights' sizes, the rank and the seed): a rerun reuses them."""
    model = Path(model_dir)
    key = hashlib.sha256(str(model.resolve()).encode() + (model / "config.json").read_bytes()
                         + str(sorted((p.name, p.stat().st_size) for p in model.glob("*.safetensors"))).encode()).hexdigest()[:12]
    paths = []
    for i in range(count):
        d = out / "lora-adapters" / f"{model.name}-{key}-r{rank}-s{seed + i}"
        if not (d / "adapter_model.safetensors").exists():
            d.mkdir(parents=True, exist_ok=True)
            _make_adapter(str(model), d, rank, seed + i)
        paths.append(d)
    return paths


def _label(k: int) -> str:
    return f"{k} adapter" + ("s" if k != 1 else "")


def run_mode(llm, items, params, lora_requests) -> dict:
    prompts = [{"prompt_token_ids": it.prompt_ids} for it in items]
    steps0 = llm.engine.stats()["steps"]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = llm.engine.stats()["steps"] - steps0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(t) for t in tokens)
    return {"seconds": seconds, "cpu_s": cpu, "output_tokens": n, "tokens_per_s": n / seconds,
            "tokens_per_cpu_s": n / cpu, "steps": steps, "outputs": tokens}


def main(argv: list[str] | None = None) -> dict:
    ap = report.parser(__doc__, "32 requests, 2 rounds")
    ap.add_argument("--requests", type=int, default=None, help="requests per mode (default 64; --quick 32)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every mode (default 3; --quick 2)")
    ap.add_argument("--adapters", default="1,4,16", help="adapter counts to mix")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-loras", type=int, default=None, help="adapter slots (default: the largest count)")
    ap.add_argument("--max-tokens", default="24,40", help="output tokens per request: lo,hi")
    ap.add_argument("--kv-memory-mib", type=int, default=512)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    requests = args.requests or (32 if args.quick else 64)
    rounds = args.rounds or (2 if args.quick else 3)
    counts = [int(c) for c in args.adapters.split(",") if c]
    max_loras = args.max_loras or max(counts)
    lo, hi = (int(v) for v in args.max_tokens.split(","))

    from qworker import LLM, LoRARequest
    from qworker.engine import SamplingParams

    out = Path(args.out)
    t = time.perf_counter()
    paths = make_adapters(args.model, out, max(counts), args.rank, args.seed)
    adapters = [LoRARequest(f"bench-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    print(f"{len(adapters)} adapters ready in {time.perf_counter() - t:.1f}s", flush=True)

    # prefix caching off: every run repeats the same prompts, so the base engine would serve them
    # all from its cache while the adapters' runs (keyed per adapter, evicting each other) would not
    common = dict(device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_memory_mib << 20, max_num_seqs=256,
                  enable_prefix_caching=False)
    base_llm = LLM(args.model, **common)
    lora_llm = LLM(args.model, enable_lora=True, max_loras=max_loras, max_lora_rank=args.rank,
                   max_cpu_loras=max(max_loras, len(adapters)), **common)
    tok = base_llm.get_tokenizer()
    items = workloads.mixed(tok, num=requests, seed=args.seed, prompt_range=(16, 128), output_range=(lo, hi))
    params = [SamplingParams(temperature=0, max_tokens=it.max_tokens, ignore_eos=True) for it in items]

    modes = {BASE: (base_llm, None), BASE_LORA_ENGINE: (lora_llm, None)}
    for k in counts:
        modes[_label(k)] = (lora_llm, [adapters[i % k] for i in range(requests)])
    # warm-up, untimed: each engine runs the workload once (the first run of new batch shapes
    # prepares oneDNN's kernels for them and took twice as long), the LoRA engine under every
    # adapter (each loaded once)
    run_mode(base_llm, items, params, None)
    run_mode(lora_llm, items, params, [adapters[i % len(adapters)] for i in range(requests)])

    names = list(modes)
    runs: dict[str, list[dict]] = {m: [] for m in names}
    first_outputs: dict[str, list[list[int]]] = {}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for m in order:
            llm, loras = modes[m]
            res = run_mode(llm, items, params, loras)
            first_outputs.setdefault(m, res.pop("outputs"))
            runs[m].append(res)
            print(f"round {r + 1}/{rounds} {m}: {res['tokens_per_s']:.1f} tok/s ({res['seconds']:.1f}s, "
                  f"{res['tokens_per_cpu_s']:.1f} tok/CPU-s)", flush=True)
    base_outputs = first_outputs[BASE]
    differs = {m: sum(a != b for a, b in zip(o, base_outputs)) / len(o) for m, o in first_outputs.items()}

    base_runs = runs[BASE]
    table_rows = []
    for m in names:
        tps = [x["tokens_per_s"] for x in runs[m]]
        ratios = [x["tokens_per_s"] / b["tokens_per_s"] for x, b in zip(runs[m], base_runs)]
        cpu_ratios = [x["tokens_per_cpu_s"] / b["tokens_per_cpu_s"] for x, b in zip(runs[m], base_runs)]
        table_rows.append({
            "mode": m,
            "adapters": 0 if m in (BASE, BASE_LORA_ENGINE) else int(m.split()[0]),
            "median_tokens_per_s": statistics.median(tps),
            "tokens_per_s": tps,
            "ratio_vs_base": statistics.median(ratios),
            "ratios": ratios,
            "median_tokens_per_cpu_s": statistics.median(x["tokens_per_cpu_s"] for x in runs[m]),
            "cpu_ratio_vs_base": statistics.median(cpu_ratios),
            "outputs_differ_from_base": differs[m],
            "median_seconds": statistics.median(x["seconds"] for x in runs[m]),
            "median_steps": statistics.median(x["steps"] for x in runs[m]),
        })
    result = {
        **report.meta(args.device, str(lora_llm.engine.runner.dtype)),
        "workload": {"requests": requests, "prompt_tokens": sum(len(i.prompt_ids) for i in items),
                     "output_tokens": sum(i.max_tokens for i in items), "rounds": rounds},
        "lora": {"rank": args.rank, "max_loras": max_loras, "targets": ALL_MODULES, "adapter_counts": counts},
        "modes": table_rows,
    }
    four = next((row for row in table_rows if row["adapters"] == 4), None)
    if four is not None:
        result["target_4_adapters_ratio"] = {"target": 0.8, "measured": four["ratio_vs_base"], "met": four["ratio_vs_base"] >= 0.8}
    report.publish(result, "lora", out, _plot, markdown)
    return result


def markdown(r: dict) -> str:
    rows = [[m["mode"], m["median_steps"], m["median_tokens_per_s"], f"{m['ratio_vs_base']:.2f}x",
             " / ".join(f"{x:.2f}" for x in m["ratios"]), m["median_tokens_per_cpu_s"], f"{m['cpu_ratio_vs_base']:.2f}x",
             f"{100 * m['outputs_differ_from_base']:.0f}%"]
            for m in r["modes"]]
    w = r["workload"]
    lines = [report.header(r), "",
             f"{w['requests']} requests ({w['prompt_tokens']} prompt tokens, {w['output_tokens']} output tokens), "
             f"rank {r['lora']['rank']} on {', '.join(p.split('_')[0] for p in r['lora']['targets'])}, "
             f"max_loras {r['lora']['max_loras']}, median of {w['rounds']} rounds", "",
             report.table(["mode", "steps", "output tokens/s", "vs base", "per-round ratios", "tokens per CPU-s", "vs base (CPU)",
                           "outputs differ from base"], rows)]
    t = r.get("target_4_adapters_ratio")
    if t:
        lines += ["", f"4 adapters mixed: {t['measured']:.2f}x the base model (target >= {t['target']}x: "
                      f"{'met' if t['met'] else 'NOT met'})"]
    return "\n".join(lines)


def _plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [m["mode"].replace(", ", "\n") for m in r["modes"]]
    report.bars(ax1, labels, [m["median_tokens_per_s"] for m in r["modes"]], "output tokens/s (median)",
                f"LoRA rank {r['lora']['rank']}, {r['workload']['requests']} requests, mixed evenly")
    x = range(len(labels))
    for shift, key, name in ((-0.2, "ratio_vs_base", "output tokens/s"), (0.2, "cpu_ratio_vs_base", "tokens per CPU-second")):
        vals = [m[key] for m in r["modes"]]
        ax2.bar([i + shift for i in x], vals, width=0.4, label=name)
        for i, v in zip(x, vals):
            ax2.annotate(f"{v:.2f}", (i + shift, v), ha="center", va="bottom", fontsize=7)
    ax2.set_xticks(list(x), labels, fontsize=7)
    ax2.set_ylabel("ratio to the base model (median over rounds)")
    ax2.set_title("against the base model, same round", fontsize=9)
    ax2.axhline(0.8, color="tab:red", lw=1, ls="--", label="target for 4 adapters (0.8x)")
    ax2.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
