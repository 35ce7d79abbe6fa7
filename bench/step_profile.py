"""Where a decode step's time goes: linears, attention, the elementwise C kernels, the LM head,
the runner's input preparation and the engine's own Python work (scheduler, sampler, output
processing), at a few batch sizes.

    python bench/step_profile.py --batches 16,32,64

Each batch: ``batch`` sequences with ~``--context`` tokens of KV, prefilled, then ``--rounds``
decode steps with timers around every piece (``time.perf_counter``; the timers cost ~1 µs per
call, ~300 calls a step). Medians per step. ``--cprofile`` adds the top functions by own time in
one extra round of steps (the engine's Python hot spots).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.drive import fill_decoding  # noqa: E402
from qworker.engine import EngineConfig, LLMEngine  # noqa: E402

MiB = 1 << 20


CLOCK = time.perf_counter


class Timers:
    def __init__(self):
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn):
        acc = self.acc

        def timed(*a, **kw):
            t = CLOCK()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] += CLOCK() - t

        return timed


def instrument(engine: LLMEngine, timers: Timers) -> None:
    m = engine.runner.model
    for layer in m.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            setattr(layer, name, timers.wrap(f"linear {name}", lin))
    m.lm_head = timers.wrap("linear lm_head", m.lm_head)
    m.attn = timers.wrap("attention (store + decode)", m.attn)
    m.norm_fn = timers.wrap("rms norm", m.norm_fn)
    m.rope = timers.wrap("rope", m.rope)
    m.swiglu = timers.wrap("swiglu", m.swiglu)
    r = engine.runner
    r._prepare = timers.wrap("runner: prepare inputs", r._prepare)
    m.forward = timers.wrap("forward", m.forward)


def profile_batch(engine: LLMEngine, batch: int, context: int, rounds: int, use_cprofile: bool) -> dict:
    ids = fill_decoding(engine, batch, context, "prof")
    for _ in range(2):
        engine.step()
    timers = Timers()
    instrument(engine, timers)
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(rounds):
        timers.acc.clear()
        t = CLOCK()
        engine.step()
        total = CLOCK() - t
        assert len(engine.scheduler.running) == batch
        for k, v in timers.acc.items():
            per_step[k].append(v)
        per_step["step"].append(total)
    prof_text = ""
    if use_cprofile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(rounds):
            engine.step()
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        prof_text = s.getvalue()
    for rid in ids:
        engine.abort(rid)
    med = {k: statistics.median(v) * 1e3 for k, v in per_step.items()}
    inner = sum(v for k, v in med.items() if k not in ("step", "forward", "runner: prepare inputs"))
    med["forward: other (embedding, splits, views, python)"] = med["forward"] - inner
    med["engine: schedule + sample + outputs (step - prepare - forward)"] = med["step"] - med["forward"] - med["runner: prepare inputs"]
    return {"batch": batch, "ms": med, "cprofile": prof_text}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--batches", default="16,32,64")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--json", default=None, help="also write the medians (ms per step, per batch) to this file")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="thread: this thread's CPU time, with torch and the kernels on one thread (a shared, loaded machine "
                         "then still gives a usable breakdown: no time-slicing, no spinning at OpenMP barriers)")
    args = ap.parse_args(argv)
    global CLOCK
    if args.clock == "thread":
        import torch

        torch.set_num_threads(1)
        CLOCK = time.thread_time
    batches = [int(b) for b in args.batches.split(",")]
    out = []
    for b in batches:
        engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                                        kv_cache_memory=max(64, b * (args.context + 64) * 46 * 1024 // MiB + 16) * MiB, swap_space=0, max_num_seqs=256))
        r = profile_batch(engine, b, args.context, args.rounds, args.cprofile)
        out.append(r)
        print(f"\nbatch {b}: step {r['ms']['step']:.1f} ms = {b / r['ms']['step'] * 1e3:.1f} tokens/s")
        for k, v in sorted(r["ms"].items(), key=lambda kv: -kv[1]):
            if k not in ("step",):
                print(f"  {k:60s} {v:8.2f} ms  {v / r['ms']['step']:6.1%}")
        if r["cprofile"]:
            print(r["cprofile"])
        del engine
    if args.json:
        import json

        Path(args.json).write_text(json.dumps([{"batch": r["batch"], "ms": r["ms"]} for r in out]))
    return out


if __name__ == "__main__":
    main()
