"""The CPU GEMM paths for the model's projections, side by side: every linear layer of the model
(fused qkv, o, gate_up, down per layer, and the LM head) once, per row count.

    python bench/gemm_paths.py                       # SmolLM2-135M's shapes, random weights
    python bench/gemm_paths.py --rows 1,16,64 --hints none,16,256

Paths: ``x @ w`` with ``w`` row-major ``[in, out]``; ``F.linear`` with ``[out, in]``; oneDNN with
each weight packed once (``torch.ops.mkldnn._reorder_linear_weight(w, batch_size_hint)``) for
each ``--hints`` value; ``panels``, qworker's own GEMM (``kernels.gemm_cpu``) with the weights as
the engine packs them here (on an AMX or AVX512_BF16 CPU, bf16 weights in AMX's tile layout),
where the C kernels build; where that layout is AMX's, ``panels, 16-column layout`` as well: the
same call on the panels layout (``csrc/gemm_bf16.c``). Weights are fresh random tensors of the
model's shapes (values do not change GEMM time; all of them together are far larger than the
caches, as in a real step).
The paths alternate round by round; medians; the fastest per row count in bold.

With ``--dtype bfloat16`` one more path, ``oneDNN fp32 act``, is what the CPU bf16 model runs: fp32
activations rounded to bf16 before each GEMM and the bf16 result converted back to fp32 (the first
hint's packing), so its distance from ``oneDNN hint=...`` is the cost of those conversions.
``--clock thread`` (with ``--threads 1``) times one thread's CPU time, for a shared machine.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench import report  # noqa: E402
from kernels import gemm_cpu  # noqa: E402


def shapes(model_dir: str) -> list[tuple[int, int]]:
    """(out, in) of every projection in one forward pass."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * hd
    q = c.num_attention_heads * hd
    layer = [(q + 2 * kv, c.hidden_size), (c.hidden_size, q), (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    return layer * c.num_hidden_layers + [(c.vocab_size, c.hidden_size)]


def main(argv=None) -> dict:
    ap = report.parser(__doc__, quick_help="rows 1,16,64, 3 rounds")
    ap.add_argument("--rows", default=None, help="default 1,8,16,32,48,64,128,256,1024")
    ap.add_argument("--hints", default="none,16,64,256", help="oneDNN batch_size_hint values ('none' = no hint)")
    ap.add_argument("--rounds", type=int, default=None, help="default 7 (--quick 3)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall")
    args = ap.parse_args(argv)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in (args.rows or ("1,16,64" if args.quick else "1,8,16,32,48,64,128,256,1024")).split(",")]
    rounds = args.rounds or (3 if args.quick else 7)
    hints = [None if h == "none" else int(h) for h in args.hints.split(",") if h]
    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    out_in = [(torch.randn(o, i, generator=gen) * 0.02).to(dtype) for o, i in shapes(args.model)]
    in_out = [w.t().contiguous() for w in out_in]
    packed = {h: [torch.ops.mkldnn._reorder_linear_weight(w, h) for w in out_in] for h in hints}
    panels = [gemm_cpu.pack_weight(w) for w in out_in] if not gemm_cpu.self_check(dtype) else None
    # where the engine packs bf16 weights in AMX's layout, the 16-column panels layout as well
    plain = ([gemm_cpu.pack_weight(w, "panels") for w in out_in]
             if panels is not None and any(gemm_cpu.is_amx_packed(w) for w in panels) else None)
    widths = sorted({w.shape[1] for w in out_in})

    def paths(n: int) -> dict:
        xs = {k: torch.randn(n, k, generator=gen).to(dtype) for k in widths}

        def matmul():
            for w in in_out:
                xs[w.shape[0]] @ w

        def linear():
            for w in out_in:
                F.linear(xs[w.shape[1]], w)

        fns = {"x @ w": matmul, "F.linear": linear}
        for name, ws in (("panels", panels), ("panels, 16-column layout", plain)):
            if ws is not None:
                def qworker_panels(ws=ws):
                    for w, w0 in zip(ws, out_in):
                        gemm_cpu.gemm(xs[w0.shape[1]], w, None, w0.shape[0])

                fns[name] = qworker_panels
        for h, ws in packed.items():
            def onednn(ws=ws):
                for w, w0 in zip(ws, out_in):
                    torch.ops.mkldnn._linear_pointwise(xs[w0.shape[1]], w, None, "none", [], "")

            fns[f"oneDNN hint={h}"] = onednn
        if dtype != torch.float32:
            x32 = {k: x.float() for k, x in xs.items()}
            ws = packed[hints[0]]

            def onednn_fp32_act():
                for w, w0 in zip(ws, out_in):
                    torch.ops.mkldnn._linear_pointwise(x32[w0.shape[1]].to(dtype), w, None, "none", [], "").float()

            fns["oneDNN fp32 act"] = onednn_fp32_act
        return fns

    result = report.meta("cpu", str(dtype).replace("torch.", ""))
    result.update(model=args.model, rounds=rounds, rows={})
    flops_per_row = 2 * sum(w.numel() for w in out_in)
    with torch.inference_mode():
        for n in rows:
            fns = paths(n)
            for f in fns.values():
                f()
            times = {k: [] for k in fns}
            for _ in range(rounds):
                for k, f in fns.items():
                    t = clock()
                    f()
                    times[k].append(clock() - t)
            ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            result["rows"][n] = {"ms": ms, "gflops": {k: flops_per_row * n / (v / 1e3) / 1e9 for k, v in ms.items()}}
            print(f"rows {n}: " + "  ".join(f"{k} {v:.1f} ms" for k, v in ms.items()), file=sys.stderr, flush=True)
    report.publish(result, "gemm_paths", args.out, plot, markdown)
    return result


def markdown(r: dict) -> str:
    names = list(next(iter(r["rows"].values()))["ms"])
    rows = []
    for n, v in r["rows"].items():
        best = min(v["ms"], key=v["ms"].get)
        rows.append([n] + [f"**{v['ms'][k]:.1f}**" if k == best else f"{v['ms'][k]:.1f}" for k in names] + [f"{v['gflops'][best]:.0f}"])
    return "\n".join([report.header(r), "", f"ms per pass over every projection of {r['model']} (median of {r['rounds']}); GFLOP/s of the fastest", "",
                      report.table(["rows", *names, "GFLOP/s"], rows)])


def plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ns = [int(n) for n in r["rows"]]
    for k in next(iter(r["rows"].values()))["gflops"]:
        ax.plot(ns, [v["gflops"][k] for v in r["rows"].values()], marker="o", label=k)
    ax.set_xscale("log")
    ax.set_xlabel("rows (tokens in the step)")
    ax.set_ylabel("GFLOP/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
