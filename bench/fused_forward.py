"""The plain CPU forward as one C call (``kernels/decoder_cpu.py``) vs the Python layer loop, on
the same engine batches, alternating step by step.

    python bench/fused_forward.py --batches 1,4,16,48 --context 250 --rounds 15 [--dtype bfloat16]

Per batch size: ``batch`` requests with ~``--context`` prompt tokens are prefilled, then one real
decode batch is captured and its forward (``runner.execute``) run ``--rounds`` times per path,
the paths alternating, with the K/V writes rewriting the same slots. Also a prefill batch
(``--prefill-tokens``) the same way. Prints medians (ms) and the ratio; both paths' logits are
checked bit for bit equal first. ``--clock thread`` times one thread's CPU time with torch and
the kernels on one thread (for a shared, loaded machine). ``--dtype bfloat16`` runs the CPU bf16
mode (bf16 weights on the panels GEMM).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qworker.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def capture_batch(engine: LLMEngine):
    """Runs one engine step and returns the batch its forward got, every row asking for logits."""
    seen = []
    real = engine.runner.execute

    def spy(batch):
        seen.append(batch)
        return real(batch)

    engine.runner.execute = spy
    try:
        engine.step()
    finally:
        engine.runner.execute = real
    batch = seen[-1]
    for c in batch.chunks:  # full logits rows (not the greedy head's one-hots): compared bit for bit below
        c.argmax_only = False
    return batch


def ab(engine: LLMEngine, batch, rounds: int, clock) -> tuple[float, float]:
    model = engine.runner.model
    times = {True: [], False: []}
    logits = {}
    for r in range(rounds + 1):
        for fused in (True, False):
            model.fused_cpu_forward = fused
            t = clock()
            out = engine.runner.execute(batch)
            dt = clock() - t
            if r == 0:
                logits[fused] = out
            else:
                times[fused].append(dt)
    model.fused_cpu_forward = True
    if not torch.equal(logits[True], logits[False]):
        raise SystemExit("fused and Python forwards differ")
    return statistics.median(times[True]), statistics.median(times[False])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(Path(__file__).resolve().parents[1] / "models" / "smollm2-135m"))
    ap.add_argument("--batches", default="1,4,16,48")
    ap.add_argument("--context", type=int, default=250)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args(argv)
    clock = time.perf_counter
    if args.clock == "thread":
        torch.set_num_threads(1)
        clock = time.thread_time
    batches = [int(b) for b in args.batches.split(",")]
    kv_bytes = (max(batches) * (args.context + 64) + args.prefill_tokens) * 48 * 1024  # ~46 KiB per token (fp32)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=256,
                                    kv_cache_memory=max(kv_bytes, 256 << 20), swap_space=0))
    if engine.runner.model.fused_layers is None:
        raise SystemExit("this model/machine does not take the fused forward (not a plain Llama on the panels GEMM)")
    rng = random.Random(0)
    print(f"{args.dtype}, threads {torch.get_num_threads()}, clock {args.clock}, context ~{args.context}, "
          f"rounds {args.rounds} (medians)")
    print(f"{'batch':>10} {'fused ms':>10} {'python ms':>10} {'python/fused':>13}")
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    n = 0
    prefill = [rng.randrange(100, 30000) for _ in range(args.prefill_tokens)]
    engine.add_request("prefill", prefill, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    rows = []

    def report(name: str, fused: float, python: float) -> None:
        rows.append({"batch": name, "fused_ms": fused * 1e3, "python_ms": python * 1e3})
        print(f"{name:>10} {fused * 1e3:10.2f} {python * 1e3:10.2f} {python / fused:12.3f}x")

    report(f"prefill {args.prefill_tokens}", *ab(engine, capture_batch(engine), args.rounds, clock))
    while engine.has_unfinished():
        engine.step()
    for batch in batches:
        for _ in range(batch):
            engine.add_request(f"r{n}", [rng.randrange(100, 30000) for _ in range(args.context)], params)
            n += 1
        while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
            engine.step()
        decode = capture_batch(engine)
        assert len(decode.chunks) == batch and all(len(c.token_ids) == 1 for c in decode.chunks)
        report(str(batch), *ab(engine, decode, args.rounds, clock))
        for rid in list(engine.requests):
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    return rows


if __name__ == "__main__":
    main()
