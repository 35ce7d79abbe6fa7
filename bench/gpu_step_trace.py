"""Where a decode step's wall time goes on a GPU: the host side (Python, launches, syncs) against
the device side (kernels), from one ``torch.profiler`` trace of a few steady decode steps.

    python bench/gpu_step_trace.py --device cuda --batch 16 --random-weights

Prints the median step time, the device's busy time per step (sum of kernel times), the number of
kernel launches and host-device syncs per step, then the top operators by host time and by device
time, then the engine's Python hot spots (cProfile). A step whose device-busy time is a small
fraction of its wall time is bound by the host: launches and Python, not by the kernels.
Runs on the CPU too (no device columns), which is how it is checked without a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench.drive import fill_decoding  # noqa: E402
from qworker.engine import EngineConfig, LLMEngine  # noqa: E402

MiB = 1 << 20
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--random-weights", action="store_true", help="time with random weights when the model folder has none")
    args = ap.parse_args(argv)
    if args.random_weights and not any(Path(args.model).glob("*.safetensors")):
        from bench.random_model import random_weight_copy

        args.model = random_weight_copy(args.model)
    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, kv_cache_memory=256 * MiB, max_num_seqs=256))
    device = engine.runner.device
    fill_decoding(engine, args.batch, args.context, "trace")
    for _ in range(3):
        engine.step()

    walls = []
    for _ in range(args.steps):
        _sync(device)
        t = time.perf_counter()
        engine.step()
        _sync(device)
        walls.append(time.perf_counter() - t)
    step_ms = statistics.median(walls) * 1e3

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        _sync(device)
    events = prof.key_averages()
    per_step = 1.0 / args.steps
    kernels = [e for e in events if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA")]
    device_busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3 * per_step
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")) * per_step
    syncs = {k: e.count * per_step for e in events for k in SYNC_EVENTS if e.key == k}
    print(f"device {device}, batch {args.batch}, context ~{args.context}: step {step_ms:.2f} ms median of {args.steps}"
          f" ({args.batch / step_ms * 1e3:.0f} tok/s)")
    if device.type == "cuda":
        print(f"device busy {device_busy_ms:.2f} ms per step ({device_busy_ms / step_ms:.0%} of the step);"
              f" {launches:.0f} launches per step; syncs per step: {syncs}")
        print(events.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.steps):
        engine.step()
    _sync(device)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(20)
    print(s.getvalue())
    return {"step_ms": step_ms, "device_busy_ms": device_busy_ms, "launches": launches, "syncs": syncs}


if __name__ == "__main__":
    main()
