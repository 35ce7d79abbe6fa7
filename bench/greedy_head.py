"""The bounded greedy head (kernels/greedy_head.py) against the full fp32 LM head + row argmax it
replaces, on the model's real head (SmolLM2-135M's tied embedding, 49152 x 576), at several row
counts, the two alternating round by round (medians). Rows are hidden-state-like: pulled toward
random vocabulary rows plus noise, so the top logits stand out as in a trained model. Every round
checks the tokens equal; the table also gives how many rows the filter settled with one
candidate.

    .venv/bin/python -m bench.greedy_head --rows 1,16,48,128 --rounds 15
"""

from __future__ import annotations

import argparse
import glob
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from kernels import gemm_cpu
from kernels.cpu import argmax_rows_cpu
from kernels.greedy_head import BoundedGreedyHead, bounded_head_supported

MODEL = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m"


def head_weight(model: Path) -> torch.Tensor:
    for f in sorted(glob.glob(str(model / "*.safetensors"))):
        w = load_file(f)
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            if name in w:
                return w[name].float()
    raise SystemExit(f"no LM head in {model}")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--rows", default="1,16,48,128")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    supported, why = bounded_head_supported()
    print(f"bounded head {'pays here' if supported else 'does not pay here: ' + why}; "
          f"threads {torch.get_num_threads()}, rounds {args.rounds} (medians, ms)")
    w = head_weight(Path(args.model))
    V, K = w.shape
    packed = gemm_cpu.pack_weight(w)
    head = BoundedGreedyHead(packed, V)
    g = torch.Generator().manual_seed(0)
    print(f"{'rows':>6} {'full ms':>9} {'bounded ms':>11} {'bounded/full':>13}")
    out = []
    for M in (int(r) for r in args.rows.split(",")):
        x = torch.randn(M, K, generator=g) * 2 + w[torch.randint(0, V, (M,), generator=g)] * 10
        full, bounded = [], []
        for r in range(args.rounds + 2):
            t = time.perf_counter()
            want = argmax_rows_cpu(gemm_cpu.gemm(x, packed, None, V))
            t1 = time.perf_counter()
            got = head.argmax(x)
            t2 = time.perf_counter()
            if not torch.equal(want, got):
                raise SystemExit(f"rows={M}: the bounded head's tokens differ from the full head's")
            if r >= 2:  # two warm-up rounds
                full.append(t1 - t)
                bounded.append(t2 - t1)
        f, b = statistics.median(full), statistics.median(bounded)
        out.append({"rows": M, "full_ms": f * 1e3, "bounded_ms": b * 1e3})
        print(f"{M:6d} {f * 1e3:9.2f} {b * 1e3:11.2f} {b / f:12.2f}x")
    return out


if __name__ == "__main__":
    main()
