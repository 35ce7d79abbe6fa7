"""bench/gpu_step_trace.py on the tiny model on the CPU (its device columns need CUDA, which the
GPU check runs): it reaches steady decode, times the steps and prints the host-side tables."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import gpu_step_trace  # noqa: E402


def test_gpu_step_trace_runs_on_the_cpu(tiny_model_dir, capsys):
    r = gpu_step_trace.main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
                             "--batch", "3", "--context", "12", "--steps", "2"])
    assert r["step_ms"] > 0
    assert r["launches"] == 0 and r["syncs"] == {}  # no CUDA events on a CPU run
    out = capsys.readouterr().out
    assert "batch 3, context ~12" in out and "Self CPU" in out and "function calls" in out
