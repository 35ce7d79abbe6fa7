"""CPU bf16 decode step with and without the fp32 copies around the bf16 GEMMs, in one run.

    python bench/bf16_gemm_io.py --batches 1,16,48,128 --steps 15

``dtype="bfloat16"`` on CPU keeps fp32 activations between the GEMMs. ``DecoderModel`` runs its
plain loop there as ``_forward_cpu_bf16``: the norms write the GEMM inputs in bf16 and o's,
gate_up's and down's bf16 outputs go straight to the C kernels (no ``.to`` either side). This
times whole engine decode steps (``batch`` sequences at ~``--context`` tokens of KV) alternating,
step by step, that loop ("bf16 io") and the model's fp32-activation loop ``DecoderModel.forward``
("fp32 acts", what ran before), on one thread with its CPU time (other jobs on a shared machine do
not enter the figures). It also checks that both give the same logits on the first step.
Medians per step, ms.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.drive import fill_decoding  # noqa: E402
from qworker.engine import EngineConfig, LLMEngine  # noqa: E402
from qworker.model.decoder import DecoderModel  # noqa: E402

MiB = 1 << 20


def run_batch(model_path: str, batch: int, context: int, steps: int) -> dict[str, float]:
    engine = LLMEngine(EngineConfig(model=model_path, dtype="bfloat16", kv_cache_memory=max(64, batch * (context + 2 * steps + 64) * 46 * 1024 // MiB + 16) * MiB,
                                    swap_space=0, max_num_seqs=256))
    m = engine.runner.model
    if m.forward.__func__ is not DecoderModel._forward_cpu_bf16:
        raise SystemExit(f"this model runs {m.forward.__name__}, not the CPU bf16 loop")
    loops = {"bf16 io": m.forward, "fp32 acts": lambda *a: DecoderModel.forward(m, *a)}
    fill_decoding(engine, batch, context, "b")
    engine.step()
    times: dict[str, list[float]] = {k: [] for k in loops}
    for i in range(2 * steps):
        name = list(loops)[i % 2]
        m.forward = loops[name]
        t = time.thread_time()
        engine.step()
        times[name].append(time.thread_time() - t)
        assert len(engine.scheduler.running) == batch
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def same_logits(model_path: str) -> bool:
    """Both loops' logits for one prefill and one decode step of a fresh runner, compared exactly."""
    from qworker.model.batch import Batch, SeqChunk
    from qworker.model.runner import ModelRunner

    r = ModelRunner(model_path, device="cpu", dtype="bfloat16")
    r.allocate_kv_cache(num_blocks=8, num_cpu_blocks=0, block_size=16)
    ids = [random.Random(0).randrange(100, 30000) for _ in range(40)]
    steps = [Batch([SeqChunk(ids[:39], 0, [0, 1, 2], True)]), Batch([SeqChunk(ids[39:], 39, [0, 1, 2], True)])]
    new = [r.execute(s) for s in steps]
    m = r.model
    m.forward = lambda *a: DecoderModel.forward(m, *a)
    return all(torch.equal(a, b) for a, b in zip(new, [r.execute(s) for s in steps]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--batches", default="1,16,48,128")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--steps", type=int, default=15, help="decode steps per loop and batch, alternating")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"identical logits (prefill + decode): {same_logits(args.model)}")
    print(f"{'batch':>5} {'fp32 acts ms':>13} {'bf16 io ms':>11} {'saved':>7}")
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        ms = run_batch(args.model, b, args.context, args.steps)
        rows.append((b, ms))
        print(f"{b:5d} {ms['fp32 acts']:13.2f} {ms['bf16 io']:11.2f} {1 - ms['bf16 io'] / ms['fp32 acts']:7.1%}", flush=True)
    return rows


if __name__ == "__main__":
    main()
