"""Mixture-of-experts MLP throughput on CPU: a stack of random MoE layers (qworker.model.moe.MoE,
expert-grouped GEMMs through the Linear backends) against the dense SwiGLU MLP with the same
active parameters (intermediate size = top_k * expert intermediate size), same run, same inputs.

    python bench/moe.py                      # H 1024, 64 experts, top-8, expert I 256, 6 layers
    python bench/moe.py --quick              # fewer rounds
    python bench/moe.py --hidden 64 --experts 8 --top-k 2 --expert-inter 32 --layers 1 --rows 1,4 --prefill 16

Rows: decode steps of batch 1/16/64 (one token per sequence) and one prefill chunk of 512 tokens.
Tokens/s = rows / (median seconds of one pass of the input through every layer's MLP). The MLPs
alone are timed (no attention, no norms): what routing and grouping cost against the dense path.
Each round feeds new random tokens (so a decode step's experts change from round to round, as they
do from step to step), and the default stack is deep enough that the dense layers' weights
(6 x 24 MiB) do not stay in a 32 MiB last-level cache between rounds any more than the experts' do.
Also timed: the same experts through :func:`kernels.moe_experts_ref` (transformers' eager loop:
one expert at a time, ``F.linear`` on the checkpoint layout), to show what the Linear backends buy,
and, where fp32 panels experts run as one C call (:mod:`kernels.moe_cpu`), the same layers through
their Python grouped path ("moe grouped": two GEMM calls per active expert).

Expect MoE to match dense at batch 1 (both read top_k experts' worth of weights) and to fall behind
as the batch grows: a decode step of B tokens touches up to min(E, B * top_k) experts, so at large
batches it reads nearly all E experts' weights while the dense MLP still reads top_k's worth.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kernels  # noqa: E402
from bench import report  # noqa: E402
from qworker.model.linear import Linear, cpu_linear_backend  # noqa: E402
from qworker.model.moe import MoE  # noqa: E402


class DenseMLP:
    """The Llama path's MLP: fused gate_up Linear, the C SwiGLU, down Linear."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, backend: str):
        self.gate_up = Linear(gate_up, None, backend)
        self.down = Linear(down, None, backend)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(kernels.silu_and_mul_cpu(self.gate_up(x)))


class GroupedMoE:
    """The same MoE layer through its Python grouped path (two Linear calls per active expert),
    which the fused C call (kernels.moe_cpu) replaces for fp32 panels experts."""

    def __init__(self, moe: MoE):
        self.moe = moe

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe._grouped(x, *self.moe.route(x))


class EagerMoE:
    """The experts as transformers' eager loop runs them (kernels.moe_experts_ref), same routing."""

    def __init__(self, moe: MoE, gate_up: torch.Tensor, down: torch.Tensor):
        self.moe, self.gate_up, self.down = moe, gate_up, down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w, ids = self.moe.route(x)
        return kernels.moe_experts_ref(x, self.gate_up, self.down, w, ids)


def main(argv=None) -> dict:
    ap = report.parser(__doc__, quick_help="3 rounds instead of 7")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-inter", type=int, default=256, help="each expert's intermediate size")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rows", default="1,16,64", help="decode batch sizes")
    ap.add_argument("--prefill", type=int, default=512, help="tokens of the prefill row (0: none)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--no-eager", action="store_true", help="skip the eager-loop column")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args(argv)
    if args.device != "cpu":
        ap.error("bench/moe.py times the CPU path; the Triton path's figures come from bench/kernel_bench.py")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    rounds = args.rounds or (3 if args.quick else 7)
    H, E, K, I, L = args.hidden, args.experts, args.top_k, args.expert_inter, args.layers
    gen = torch.Generator().manual_seed(args.seed)
    experts = [((torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(dtype), (torch.randn(E, H, I, generator=gen) / I**0.5).to(dtype))
               for _ in range(L)]
    routers = [torch.randn(E, H, generator=gen) for _ in range(L)]
    dense_w = [((torch.randn(2 * K * I, H, generator=gen) / H**0.5).to(dtype), (torch.randn(H, K * I, generator=gen) / (K * I)**0.5).to(dtype))
               for _ in range(L)]
    backend = cpu_linear_backend(dtype, [experts[0][0][0], experts[0][1][0], *dense_w[0]])
    act = torch.float32
    moes = [MoE(r, gu, d, K, True, backend, act, "cpu") for r, (gu, d) in zip(routers, experts)]
    paths = {"moe": moes, "dense": [DenseMLP(gu, d, backend) for gu, d in dense_w]}
    if moes[0].packed is not None:  # the one-call kernel runs "moe": its Python grouped path beside it
        paths["moe grouped"] = [GroupedMoE(m) for m in moes]
    if not args.no_eager:
        paths["moe eager loop"] = [EagerMoE(m, gu, d) for m, (gu, d) in zip(moes, experts)]
    if args.no_eager:
        del experts
    cases = [(f"decode batch {b}", b) for b in (int(r) for r in args.rows.split(",") if r)]
    if args.prefill:
        cases.append((f"prefill {args.prefill}", args.prefill))

    result = report.meta("cpu", str(dtype).replace("torch.", ""))
    result.update(shape=dict(hidden=H, experts=E, top_k=K, expert_inter=I, dense_inter=K * I, layers=L), linear_backend=backend,
                  rounds=rounds, cases=[])
    with torch.inference_mode():
        for name, rows in cases:
            xs = [torch.randn(rows, H, generator=gen).to(act) for _ in range(rounds + 1)]
            active = statistics.mean(len(set(moes[0].route(x)[1].flatten().tolist())) for x in xs)
            for layers in paths.values():  # warm-up: oneDNN primitives, first-touch of the weights
                for layer in layers:
                    layer(xs[-1])
            times = {p: [] for p in paths}
            for x in xs[:-1]:
                for p, layers in paths.items():
                    start = time.perf_counter()
                    for layer in layers:
                        layer(x)
                    times[p].append(time.perf_counter() - start)
            med = {p: statistics.median(t) for p, t in times.items()}
            case = dict(case=name, rows=rows, active_experts_layer0=active, ms={p: v * 1e3 for p, v in med.items()},
                        tokens_per_s={p: rows / v for p, v in med.items()})
            case["moe_vs_dense"] = case["tokens_per_s"]["moe"] / case["tokens_per_s"]["dense"]
            result["cases"].append(case)
            print(f"{name}: " + "  ".join(f"{p} {v * 1e3:.2f} ms" for p, v in med.items()), file=sys.stderr, flush=True)
    report.publish(result, "moe", args.out, plot, markdown)
    return result


def markdown(r: dict) -> str:
    s = r["shape"]
    paths = list(r["cases"][0]["tokens_per_s"])
    rows = [[c["case"], f"{c['active_experts_layer0']:.3g}/{s['experts']}", *(round(c["tokens_per_s"][p]) for p in paths), f"{c['moe_vs_dense']:.2f}x"]
            for c in r["cases"]]
    return "\n".join([
        report.header(r), "",
        f"{s['layers']} layers, hidden {s['hidden']}: MoE {s['experts']} experts top-{s['top_k']} of intermediate {s['expert_inter']} "
        f"vs dense intermediate {s['dense_inter']} (equal active parameters); linear backend {r['linear_backend']}; "
        f"tokens/s through the MLPs, median of {r['rounds']}", "",
        report.table(["step", "experts hit per step", *(f"{p} tok/s" for p in paths), "moe / dense"], rows)])


def plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    paths = list(r["cases"][0]["tokens_per_s"])
    fig, ax = plt.subplots(figsize=(7, 3.5))
    n = len(paths)
    for i, p in enumerate(paths):
        xs = [j + (i - (n - 1) / 2) * 0.8 / n for j in range(len(r["cases"]))]
        ax.bar(xs, [c["tokens_per_s"][p] for c in r["cases"]], width=0.8 / n, label=p)
    ax.set_xticks(range(len(r["cases"])), [c["case"] for c in r["cases"]], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (MLPs only)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
