"""The packed fp32 GEMM (kernels/gemm_cpu.py, csrc/gemm_f32.c) against oneDNN's packed fp32 GEMM
(torch.ops.mkldnn._linear_pointwise, what the "onednn" Linear backend runs), on one decode step's
projections of SmolLM2-135M: every projection of its 30 layers (fused qkv 576->960, o 576->576,
fused gate_up 576->3072, down 1536->576) plus the LM head (576->49152), each with its own fresh
random weight (~540 MB per format: far larger than cache, like a real step), at several row
counts. Rounds alternate which GEMM runs first; the table gives medians.

    .venv/bin/python -m bench.small_gemm --threads 1 --clock thread   # one thread's CPU time
    .venv/bin/python -m bench.small_gemm --threads 2 --clock wall

``--clock thread`` (time.thread_time of the calling thread) is only meaningful with one thread:
both GEMMs then run entirely on the calling thread, and the figure is robust to other jobs on a
shared machine. Ratio = oneDNN time / ours (> 1: ours is faster), of the medians; "min ratio" is
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
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--no-lm-head", action="store_true")
    ap.add_argument("--mc", type=int, default=0, help="kernel rows per x block (0 = default)")
    ap.add_argument("--group", type=int, default=0, help="kernel panels per weight group (0 = default)")
    ap.add_argument("--isa", default=None, help="kernel build to run (default: the best available)")
    args = ap.parse_args()
    if args.clock == "thread" and args.threads != 1:
        ap.error("--clock thread measures one thread's CPU time: use it with --threads 1")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    isa = args.isa or kcpu.cpu_isa()
    if not kcpu.cpu_kernels_available():
        raise SystemExit("the CPU kernels are unavailable (no compiler?): nothing to compare")

    torch.manual_seed(0)
    shp = shapes(args.layers, not args.no_lm_head)
    ours, onednn = [], []
    for N, K in shp:
        w = torch.randn(N, K) * K ** -0.5
        ours.append(gemm_cpu.pack_weight(w))
        onednn.append(torch.ops.mkldnn._reorder_linear_weight(w, None))
    weight_mb = sum(N * K for N, K in shp) * 4 / 1e6
    rows_list = [int(r) for r in args.rows.split(",")]

    def run_ours(xs):
        return [gemm_cpu.gemm(xs[K], pw, None, N, mc=args.mc, group=args.group) for (N, K), pw in zip(shp, ours)]

    def run_onednn(xs):
        return [torch.ops.mkldnn._linear_pointwise(xs[K], pw, None, "none", [], "") for (N, K), pw in zip(shp, onednn)]

    print(f"# {len(shp)} projections ({args.layers} layers{'' if args.no_lm_head else ' + LM head'}), "
          f"{weight_mb:.0f} MB of weights per format; threads={args.threads}, clock={args.clock}, "
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


if __name__ == "__main__":
    main()
