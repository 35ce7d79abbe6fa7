"""The packed fp32 GEMM (kernels/gemm_cpu.py, csrc/gemm_f32.c) against oneDNN's packed fp32 GEMM
(torch.ops.mkldnn._linear_pointwise, what the "onednn" Linear backend runs), on one decode step's
projections of SmolLM2-135M: every projection of its 30 layers (fused qkv 576->960, o 576->576,
fused gate_up 576->3072, down 1536->576) plus the LM head (576->49152), each with its own fresh
random weight (~540 MB per format: far larger than cache, like a real step), at several row
counts. Rounds alternate which GEMM runs first; the table gives medians.

    .venv/bin/python -m bench.small_gemm --threads 1 --clock thread   # one thread's CPU time
    .venv/bin/python -m bench.small_gemm --threads 2 --clock wall
    .venv/bin/python -m bench.small_gemm --dtype bfloat16 --threads 1,2 --rows 1,4,16,48,128,256

``--threads`` takes a list (one table per count). ``--clock thread`` (time.thread_time of the
calling thread) is only meaningful with one thread: both GEMMs then run entirely on the calling
thread, and the figure is robust to other jobs on a shared machine; the default ``auto`` takes it
for one thread and wall time for more.

``--dtype bfloat16``: the bf16-weight panels GEMM (``csrc/gemm_bf16.c``: bf16 weights and x, fp32
accumulation, bf16 output, as the CPU bf16 mode calls it) against the fp32 panels GEMM and
oneDNN's fp32 GEMM on the same (bf16-valued) weights and x, and oneDNN's bf16 GEMM where this CPU
has bf16 GEMM hardware (AVX512_BF16 or AMX; elsewhere oneDNN emulates it). Ratios are
other / bf16-panels (> 1: the bf16 panels are faster); "w GB/s" is the bf16 weights' bytes over
the median time (the decode floor is memory bandwidth); "max rel" compares the bf16 output with
the fp32 panels' (bf16 output rounding: ~4e-3). Ratio = oneDNN time / ours (> 1: ours is faster), of the medians; "min ratio" is
the same of each side's fastest round (the least disturbed by other jobs). GF/s from the medians.
max abs / max rel: the largest difference from oneDNN's output over all projections (rel: divided
by the largest |output| of that projection).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kernels import cpu as kcpu
from kernels import gemm_cpu

HIDDEN, INTER, QKV, VOCAB, LAYERS = 576, 1536, 960, 49152, 30


def shapes(layers: int, lm_head: bool) -> list[tuple[int, int]]:
    """(N, K) of every projection of one step."""
    per_layer = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    return per_layer * layers + ([(VOCAB, HIDDEN)] if lm_head else [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,48,64,128,256,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1", help="thread counts, comma-separated (a table each)")
    ap.add_argument("--clock", choices=("auto", "thread", "wall"), default="auto",
                    help="auto: thread CPU time with one thread, else wall time")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="bfloat16: the bf16-weight panels GEMM against fp32 panels and oneDNN")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--no-lm-head", action="store_true")
    ap.add_argument("--mc", type=int, default=0, help="kernel rows per x block (0 = default)")
    ap.add_argument("--group", type=int, default=0, help="kernel panels per weight group (0 = default)")
    ap.add_argument("--isa", default=None, help="kernel build to run (default: the best available)")
    args = ap.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]
    if args.clock == "thread" and thread_counts != [1]:
        ap.error("--clock thread measures one thread's CPU time: use it with --threads 1")
    isa = args.isa or kcpu.cpu_isa()
    if not kcpu.cpu_kernels_available():
        raise SystemExit("the CPU kernels are unavailable (no compiler?): nothing to compare")
    torch.manual_seed(0)
    shp = shapes(args.layers, not args.no_lm_head)
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.dtype == "bfloat16":
        return bench_bf16(args, shp, rows_list, thread_counts, isa)
    for threads in thread_counts:
        bench_fp32(args, shp, rows_list, threads, isa)


def _clock(args, threads: int):
    return time.thread_time if args.clock == "thread" or (args.clock == "auto" and threads == 1) else time.perf_counter


def bench_fp32(args, shp, rows_list, threads: int, isa: str) -> None:
    torch.set_num_threads(threads)
    clock = _clock(args, threads)
    clock_name = "thread" if clock is time.thread_time else "wall"
    torch.manual_seed(0)
    ours, onednn = [], []
    for N, K in shp:
        w = torch.randn(N, K) * K ** -0.5
        ours.append(gemm_cpu.pack_weight(w))
        onednn.append(torch.ops.mkldnn._reorder_linear_weight(w, None))
    weight_mb = sum(N * K for N, K in shp) * 4 / 1e6

    def run_ours(xs):
        return [gemm_cpu.gemm(xs[K], pw, None, N, mc=args.mc, group=args.group) for (N, K), pw in zip(shp, ours)]

    def run_onednn(xs):
        return [torch.ops.mkldnn._linear_pointwise(xs[K], pw, None, "none", [], "") for (N, K), pw in zip(shp, onednn)]

    print(f"# {len(shp)} projections ({args.layers} layers{'' if args.no_lm_head else ' + LM head'}), "
          f"{weight_mb:.0f} MB of weights per format; threads={threads}, clock={clock_name}, "
          f"rounds={args.rounds}, kernel build={isa} (gemm path {gemm_cpu.kernel_isa()}), torch {torch.__version__}")
    print(f"{'rows':>5} {'ours ms':>9} {'oneDNN ms':>10} {'ratio':>6} {'ours GF/s':>10} {'oDNN GF/s':>10} "
          f"{'min ratio':>9} {'max abs':>9} {'max rel':>9}")
    with kcpu.using_isa(isa):
        for M in rows_list:
            xs = {K: torch.randn(M, K) for K in {K for _, K in shp}}
            flops = 2.0 * M * sum(N * K for N, K in shp)
            # correctness against oneDNN (and warm-up: first touches, the kernel build)
            a, b = run_ours(xs), run_onednn(xs)
            max_abs = max((p - q).abs().max().item() for p, q in zip(a, b))
            max_rel = max(((p - q).abs().max() / q.abs().max().clamp_min(1e-30)).item() for p, q in zip(a, b))
            del a, b
            t_ours, t_dnn = [], []
            for r in range(args.rounds):
                order = [(run_ours, t_ours), (run_onednn, t_dnn)]
                for fn, acc in order if r % 2 == 0 else order[::-1]:
                    t0 = clock()
                    fn(xs)
                    acc.append(clock() - t0)
            mo, md = statistics.median(t_ours), statistics.median(t_dnn)
            print(f"{M:>5} {mo * 1e3:>9.1f} {md * 1e3:>10.1f} {md / mo:>6.2f} {flops / mo / 1e9:>10.1f} "
                  f"{flops / md / 1e9:>10.1f} {min(t_dnn) / min(t_ours):>9.2f} {max_abs:>9.2e} {max_rel:>9.2e}", flush=True)


def _onednn_bf16_hw() -> str:
    """Why oneDNN's bf16 GEMM is left out here ("" when it is timed): it needs bf16 GEMM hardware."""
    cpu = torch.cpu
    if not any(getattr(cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")):
        return f"no AVX512_BF16/AMX (torch CPU capability {torch.backends.cpu.get_cpu_capability()}): oneDNN would emulate bf16"
    return ""


def bench_bf16(args, shp, rows_list, thread_counts, isa: str) -> None:
    """The bf16-weight panels GEMM against the fp32 panels and oneDNN (see the module docstring)."""
    no_dnn16 = _onednn_bf16_hw()
    names = ["panels-bf16", "panels-fp32", "oneDNN-fp32"] + ([] if no_dnn16 else ["oneDNN-bf16"])
    weights: dict[str, list] = {n: [] for n in names}
    for N, K in shp:
        wb = (torch.randn(N, K) * K ** -0.5).to(torch.bfloat16)
        weights["panels-bf16"].append(gemm_cpu.pack_weight(wb))
        weights["panels-fp32"].append(gemm_cpu.pack_weight(wb.float()))
        weights["oneDNN-fp32"].append(torch.ops.mkldnn._reorder_linear_weight(wb.float(), None))
        if not no_dnn16:
            weights["oneDNN-bf16"].append(torch.ops.mkldnn._reorder_linear_weight(wb, None))
    n_params = sum(N * K for N, K in shp)

    def runner(name):
        ws = weights[name]
        if name == "panels-bf16":  # bf16 x in, bf16 out: how the CPU bf16 mode calls it
            return lambda xs: [gemm_cpu.gemm(xs[K, 16], w, None, N, mc=args.mc, group=args.group) for (N, K), w in zip(shp, ws)]
        if name == "panels-fp32":
            return lambda xs: [gemm_cpu.gemm(xs[K, 32], w, None, N, mc=args.mc, group=args.group) for (N, K), w in zip(shp, ws)]
        bits = 16 if name == "oneDNN-bf16" else 32
        return lambda xs: [torch.ops.mkldnn._linear_pointwise(xs[K, bits], w, None, "none", [], "") for (N, K), w in zip(shp, ws)]

    runners = {n: runner(n) for n in names}
    print(f"# {len(shp)} projections ({args.layers} layers{'' if args.no_lm_head else ' + LM head'}), "
          f"{n_params * 2 / 1e6:.0f} MB of bf16 weights ({n_params * 4 / 1e6:.0f} MB fp32); rounds={args.rounds}, "
          f"kernel build={isa} (bf16 gemm path {gemm_cpu.kernel_isa(torch.bfloat16)}), torch {torch.__version__}")
    if no_dnn16:
        print(f"# oneDNN-bf16 not timed: {no_dnn16}")
    others = names[1:]
    print(f"{'rows':>5} {'thr':>3} {'clock':>6} " + " ".join(f"{n + ' ms':>15}" for n in names) + " "
          + " ".join(f"{n.replace('panels-', 'p').replace('oneDNN-', 'dnn') + '/pbf16':>12}" for n in others)
          + f" {'bf16 GF/s':>9} {'w GB/s':>7} {'max rel':>9}")
    with kcpu.using_isa(isa):
        for threads in thread_counts:
            torch.set_num_threads(threads)
            clock = _clock(args, threads)
            for M in rows_list:
                xs = {}
                for K in {K for _, K in shp}:
                    xb = torch.randn(M, K).to(torch.bfloat16)
                    xs[K, 16], xs[K, 32] = xb, xb.float()
                # correctness (and warm-up): bf16 output against the fp32 panels on the same values
                a, b = runners["panels-bf16"](xs), runners["panels-fp32"](xs)
                max_rel = max(((p.float() - q).abs().max() / q.abs().max().clamp_min(1e-30)).item() for p, q in zip(a, b))
                for n in names[2:]:
                    runners[n](xs)
                del a, b
                times: dict[str, list[float]] = {n: [] for n in names}
                for r in range(args.rounds):
                    order = names[r % len(names):] + names[:r % len(names)]  # each GEMM takes each slot in turn
                    for n in order:
                        t0 = clock()
                        runners[n](xs)
                        times[n].append(clock() - t0)
                med = {n: statistics.median(t) for n, t in times.items()}
                base = med["panels-bf16"]
                print(f"{M:>5} {threads:>3} {'thread' if clock is time.thread_time else 'wall':>6} "
                      + " ".join(f"{med[n] * 1e3:>15.2f}" for n in names) + " "
                      + " ".join(f"{med[n] / base:>12.2f}" for n in others)
                      + f" {2.0 * M * n_params / base / 1e9:>9.1f} {n_params * 2 / base / 1e9:>7.1f} {max_rel:>9.2e}", flush=True)


if __name__ == "__main__":
    main()
