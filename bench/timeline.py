"""Where the time of a whole run goes, step by step: prefill, steady decode and the shrinking batch
at the end, each decode batch size against the time to stream the weights (and the KV it reads)
once at this machine's memory bandwidth.

    python bench/timeline.py                          # peers.py's 48-request mixed workload, fp32
    python bench/timeline.py --dtype bfloat16 --num-requests 128
    python bench/timeline.py --threads 1              # one thread, its CPU time: a shared machine

The workload is ``bench/peers.py``'s (``bench/workloads.mixed``: prompts 16-256 tokens, outputs
32-256, greedy, EOS ignored, every request submitted at once) through an ``LLMEngine`` with the
defaults peers.py gives qworker (1 GiB of KV). Every ``engine.step()`` is timed (wall clock, and
the process's CPU time, which is the useful clock with ``--threads 1`` on a shared machine) and
classified from the scheduler's output: a step with prompt tokens is "prefill" (chunked prefill
may carry decodes along), a decode-only step at the run's largest decode batch is "steady decode",
a decode-only step below it is "tail" (requests finishing at different times) or "ramp" (before
the largest batch was first reached).

Per decode batch-size bucket: steps, time, ms per step, and two floors measured in the same run on
the same threads and clock: memory = (weight bytes + the KV bytes the step's attention reads) /
bandwidth (2 x bytes / time of a large ``torch`` copy: read + write), and compute = the step's GEMM
FLOPs (2 x weights x sequences) / the GFLOP/s of one large GEMM in the model's dtype through the
same oneDNN path. ms / max(floors) near 1: the step is bounded by memory or arithmetic; far above
it: attention, per-call overhead, Python.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import workloads  # noqa: E402

MiB = 1 << 20
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 96, 128, 192, 256)


def bandwidth_gb_s(mib: int = 256, reps: int = 7, clock=time.perf_counter) -> float:
    src = torch.ones(mib * MiB // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        t = clock()
        dst.copy_(src)
        times.append(clock() - t)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def gemm_gflops(dtype: torch.dtype, clock, rows: int = 256, n: int = 1536, k: int = 576, reps: int = 7) -> float:
    """GFLOP/s of a packed oneDNN linear large enough to be compute-bound (the model's path)."""
    w = torch.randn(n * 4, k).to(dtype)
    x = torch.randn(rows, k).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    times = []
    for _ in range(reps):
        t = clock()
        for _ in range(5):
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        times.append((clock() - t) / 5)
    return 2 * rows * n * 4 * k / statistics.median(times) / 1e9


def weight_bytes(model) -> int:
    """Bytes of every projection's weight (what a decode step streams); the embedding is a lookup."""
    total = 0
    lins = [model.lm_head]
    for layer in model.layers:
        lins += [getattr(layer, n, None) for n in ("qkv", "o", "gate_up", "down")]
    for lin in lins:
        if lin is not None and hasattr(lin, "out_features"):
            total += lin.out_features * lin.in_features * lin.weight.element_size()
    return total


def bucket(n: int) -> int:
    return next(b for b in BUCKETS if n <= b) if n <= BUCKETS[-1] else n


def run(args) -> dict:
    from transformers import AutoTokenizer

    from qworker.engine import EngineConfig, LLMEngine, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    items = workloads.mixed(tok, num=args.num_requests, seed=args.seed, prompt_range=(16, args.max_prompt), output_range=(min(32, args.max_output), args.max_output))
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_memory_mib * MiB))
    model = engine.runner.model
    wbytes = weight_bytes(model)
    kv_per_token = sum(k.element_size() * k[0].numel() // k.shape[1] * 2 for k, _ in engine.runner.kv.layers) if hasattr(engine.runner, "kv") else 0
    clock = time.process_time if args.threads == 1 else time.perf_counter
    bw = bandwidth_gb_s(clock=clock)
    gflops = gemm_gflops(model.lm_head.weight.dtype if model.linear_backend == "onednn" else torch.float32, clock)
    # warm-up: two short requests (first calls build oneDNN primitives and the kernels)
    for i in range(2):
        engine.add_request(f"warm{i}", items[i].prompt_ids[:16], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    captured = []
    real_schedule = engine.scheduler.schedule

    def schedule(*a, **kw):
        out = real_schedule(*a, **kw)
        prefill = sum(s.num_new_tokens for s in out.scheduled if s.seq.num_output_tokens == 0 or s.num_new_tokens > 1)
        decodes = sum(1 for s in out.scheduled if s.seq.num_output_tokens > 0 and s.num_new_tokens == 1)
        context = sum(s.seq.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
        captured.append((prefill, decodes, context))
        return out

    engine.scheduler.schedule = schedule
    for i, it in enumerate(items):
        engine.add_request(f"r{i}", it.prompt_ids, SamplingParams(temperature=0, max_tokens=it.max_tokens, ignore_eos=True))
    steps = []
    t_run, c_run = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        n = len(captured)
        t, c = time.perf_counter(), time.process_time()
        engine.step()
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        if len(captured) > n:
            prefill, decodes, context = captured[-1]
            steps.append(dict(prefill=prefill, decodes=decodes, context=context, wall=wall, cpu=cpu))
    total_wall, total_cpu = time.perf_counter() - t_run, time.process_time() - c_run
    return dict(steps=steps, total_wall=total_wall, total_cpu=total_cpu, weight_bytes=wbytes, kv_bytes_per_token=kv_per_token,
                bandwidth_gb_s=bw, gemm_gflops=gflops, weight_params=wbytes // model.lm_head.weight.element_size(),
                output_tokens=sum(it.max_tokens for it in items), prompt_tokens=sum(len(it.prompt_ids) for it in items),
                linear_backend=getattr(model, "linear_backend", "?"))


def report(r: dict, clock: str) -> None:
    steps = r["steps"]
    peak = max((s["decodes"] for s in steps if s["prefill"] == 0), default=0)
    first_peak = next((i for i, s in enumerate(steps) if s["prefill"] == 0 and s["decodes"] == peak), len(steps))
    phases: dict[str, list] = collections.defaultdict(list)
    for i, s in enumerate(steps):
        if s["prefill"]:
            phases["prefill (+ decodes riding along)"].append(s)
        elif s["decodes"] == peak:
            phases[f"steady decode (batch {peak})"].append(s)
        elif i < first_peak:
            phases["ramp (decode-only, before the peak batch)"].append(s)
        else:
            phases["tail (decode-only, shrinking batch)"].append(s)
    total = sum(s[clock] for s in steps)
    print(f"\n{len(steps)} steps, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens; run {r['total_wall']:.1f} s wall, "
          f"{r['total_cpu']:.1f} s CPU; useful tokens/s {r['output_tokens'] / r['total_wall']:.1f} (wall), "
          f"{r['output_tokens'] / r['total_cpu']:.1f} (CPU); linears {r['linear_backend']}; weights {r['weight_bytes'] / MiB:.0f} MiB; "
          f"bandwidth {r['bandwidth_gb_s']:.1f} GB/s (copy), GEMM {r['gemm_gflops']:.0f} GFLOP/s; clock: {clock}")
    print("\n| phase | steps | seconds | share | decode tokens | decode tokens/s |\n|---|---:|---:|---:|---:|---:|")
    for name, ss in phases.items():
        sec = sum(s[clock] for s in ss)
        out = sum(s["decodes"] for s in ss)
        print(f"| {name} | {len(ss)} | {sec:.2f} | {sec / total:.0%} | {out} | {out / sec if sec else 0:.0f} |")
    print("\n| decode batch (decode-only steps) | steps | seconds | share of run | ms/step | memory floor ms | compute floor ms | ms / max floor | tokens/s |"
          "\n|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    by: dict[int, list] = collections.defaultdict(list)
    for s in steps:
        if not s["prefill"]:
            by[bucket(s["decodes"])].append(s)
    for b in sorted(by):
        ss = by[b]
        sec = sum(s[clock] for s in ss)
        ms = statistics.median(s[clock] for s in ss) * 1e3
        mem = statistics.median((r["weight_bytes"] + s["context"] * r["kv_bytes_per_token"]) / (r["bandwidth_gb_s"] * 1e9) for s in ss) * 1e3
        flops = statistics.median(2 * r["weight_params"] * s["decodes"] / (r["gemm_gflops"] * 1e9) for s in ss) * 1e3
        toks = sum(s["decodes"] for s in ss)
        print(f"| <= {b} | {len(ss)} | {sec:.2f} | {sec / total:.0%} | {ms:.1f} | {mem:.1f} | {flops:.1f} | {ms / max(mem, flops):.1f}x | {toks / sec:.0f} |")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--kv-memory-mib", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch (and kernel) threads; 0: leave as is")
    args = ap.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    r = run(args)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report(r, "cpu" if args.threads == 1 else "wall")
    return r


if __name__ == "__main__":
    main()
