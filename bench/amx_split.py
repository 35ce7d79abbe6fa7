"""bf16 on AMX against bf16 on AVX-512 (and fp32), one decode-step profile each, interleaved.

    python bench/amx_split.py --batches 48 --rounds 3

oneDNN picks its GEMM kernels by the CPU's ISA at run time; ``ONEDNN_MAX_CPU_ISA`` caps that
choice, so the same build runs the bf16 linears on AMX tiles (default on a CPU with AMX) or on
AVX-512 with AVX512_BF16 dot products (``AVX512_CORE_BF16``). Each configuration is one
``bench/step_profile.py`` process (``--clock thread``: one thread's CPU time, so other work on a
shared machine does not enter the figures); the configurations alternate round by round and the
table shows, per profile row, the median over rounds of each one's per-step medians, with the
ratios taken within this run.

Before the profiles, one short engine run per bf16 configuration with ``ONEDNN_VERBOSE=1`` lists
the oneDNN implementations the model's linears actually ran (e.g. ``brg_matmul:avx10_1_512_amx``),
so the table says which kernels it measured.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "fp32": ("float32", {}),
    "bf16 AMX": ("bfloat16", {}),
    "bf16 AVX-512": ("bfloat16", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}),
}

_VERBOSE_SNIPPET = """
import sys
sys.path.insert(0, {root!r})
from qworker.engine import EngineConfig, LLMEngine, SamplingParams
e = LLMEngine(EngineConfig(model={model!r}, dtype={dtype!r}, kv_cache_memory=64 << 20, swap_space=0))
for i in range(4):
    e.add_request(str(i), list(range(100, 140)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
while e.has_unfinished():
    e.step()
"""


def cpu_flags() -> list[str]:
    """The CPU's vector and matrix flags that matter for these kernels (x86 /proc/cpuinfo)."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    have = set(line.split())
    return [f for f in wanted if f in have]


def onednn_implementations(model: str, dtype: str, env: dict) -> dict[str, int]:
    """oneDNN primitive executions of a short engine run, counted by (primitive, implementation, source dtype)."""
    code = _VERBOSE_SNIPPET.format(root=str(ROOT), model=model, dtype=dtype)
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env, "ONEDNN_VERBOSE": "1"},
                          capture_output=True, text=True, timeout=600, check=True)
    counts: collections.Counter = collections.Counter()
    for line in proc.stdout.splitlines():
        parts = line.split(",")
        if len(parts) > 8 and parts[2] == "primitive" and parts[3] == "exec" and parts[5] in ("inner_product", "matmul"):
            src = next((p.split(":")[1] for p in parts[8].split() if p.startswith("src:")), "?")
            counts[f"{parts[5]} {parts[6]} src {src}"] += 1
    return dict(counts)


def profile(model: str, dtype: str, env: dict, batches: str, steps: int, context: int) -> dict[int, dict[str, float]]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "step_profile.py"), "--model", model, "--dtype", dtype,
                               "--batches", batches, "--rounds", str(steps), "--context", str(context), "--clock", "thread",
                               "--json", f.name], env={**os.environ, **env}, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"step_profile.py failed ({dtype}, {env}):\n{proc.stderr[-2000:]}")
        return {r["batch"]: r["ms"] for r in json.loads(Path(f.name).read_text())}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--batches", default="48")
    ap.add_argument("--rounds", type=int, default=3, help="profile processes per configuration, interleaved")
    ap.add_argument("--steps", type=int, default=7, help="decode steps per profile (step_profile --rounds)")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"any of {','.join(CONFIGS)}")
    ap.add_argument("--no-verbose-check", action="store_true")
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.configs.split(",")]
    print(f"CPU flags: {' '.join(cpu_flags())}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if not args.no_verbose_check:
        for name in names:
            dtype, env = CONFIGS[name]
            impls = onednn_implementations(args.model, dtype, env)
            print(f"{name}: oneDNN ran " + "; ".join(f"{k} x{v}" for k, v in sorted(impls.items(), key=lambda kv: -kv[1])))
    runs: dict[str, list[dict[int, dict[str, float]]]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in names:
            dtype, env = CONFIGS[name]
            runs[name].append(profile(args.model, dtype, env, args.batches, args.steps, args.context))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    out = {}
    for b in (int(x) for x in args.batches.split(",")):
        med = {n: {k: statistics.median(r[b][k] for r in runs[n]) for k in runs[n][0][b]} for n in names}
        rows = sorted(med[names[0]], key=lambda k: -med[names[0]][k])
        print(f"\nbatch {b}, ms per decode step (one thread's CPU time, median of {args.rounds} processes x {args.steps} steps)")
        head = "| | " + " | ".join(names) + " | " + " | ".join(f"{names[0]} / {n}" for n in names[1:]) + " |"
        print(head)
        print("|---" * (1 + 2 * len(names) - 1) + "|")
        for k in rows:
            vals = [med[n].get(k, float("nan")) for n in names]
            ratios = [vals[0] / v if v else float("nan") for v in vals[1:]]
            print(f"| {k} | " + " | ".join(f"{v:.2f}" for v in vals) + " | " + " | ".join(f"{x:.2f}x" for x in ratios) + " |")
        tps = [b / med[n]["step"] * 1e3 for n in names]
        print("| tokens/s | " + " | ".join(f"{t:.0f}" for t in tps) + " | " + " | ".join(f"{t / tps[0]:.2f}x" for t in tps[1:]) + " |")
        out[b] = med
    return out


if __name__ == "__main__":
    main()
