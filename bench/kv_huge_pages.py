"""Decode attention over a KV pool on 4 KiB pages vs the same pool on transparent huge pages
(``qworker.model.kv_cache.huge_page_zeros``), alternating in one process.

    python bench/kv_huge_pages.py --batch 48 --threads 1

SmolLM2-135M's attention shapes (30 layers, 9 query / 3 KV heads of 64), ``--blocks`` blocks of 16
tokens per layer, each sequence's blocks drawn at random from the pool (as after churn), context
``--context``; the decode kernel over every layer is timed ``--rounds`` times per pool (the first
round discarded), medians. ``--threads 1`` times this thread's CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels  # noqa: E402
from qworker.model.kv_cache import huge_page_zeros  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=48)
    ap.add_argument("--context", type=int, default=250)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    shape, hq, d = (args.blocks, 16, 3, 64), 9, 64

    def pool(alloc):
        layers = []
        for _ in range(args.layers):
            k, v = alloc(shape, torch.float32), alloc(shape, torch.float32)
            k.copy_(torch.randn(shape, generator=gen))
            v.copy_(torch.randn(shape, generator=gen))
            layers.append((k, v))
        return layers

    pools = {"4k": pool(lambda s, dt: torch.zeros(s, dtype=dt)), "huge": pool(huge_page_zeros)}
    per_seq = -(-args.context // 16)
    if args.batch * per_seq > args.blocks:
        raise SystemExit(f"--blocks {args.blocks} is too few for {args.batch} sequences of {args.context} tokens")
    tables = torch.randperm(args.blocks, generator=gen)[: args.batch * per_seq].view(args.batch, per_seq).to(torch.int32)
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)
    q = torch.randn(args.batch, hq, d, generator=gen)
    times: dict[str, list[float]] = {name: [] for name in pools}
    for r in range(args.rounds + 1):
        for name, layers in pools.items():
            start = clock()
            for k, v in layers:
                kernels.paged_decode_attention_cpu(q, k, v, tables, lens, d**-0.5)
            if r:
                times[name].append(clock() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"batch {args.batch}, context {args.context}, {args.threads} thread(s), {args.rounds} rounds (medians): "
          f"4 KiB pages {med['4k'] * 1e3:.2f} ms, huge pages {med['huge'] * 1e3:.2f} ms, huge / 4 KiB {med['huge'] / med['4k']:.3f}")
    return med


if __name__ == "__main__":
    main()
