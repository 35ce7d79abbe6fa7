"""bench/timeline.py on the tiny model: every step of the run is timed and classified, and the
report's phases add up to the run (the figures themselves are for an idle machine, not tests)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import timeline  # noqa: E402


def test_timeline_small_run(tiny_model_dir, capsys):
    r = timeline.main(["--model", str(tiny_model_dir), "--num-requests", "3", "--max-prompt", "24", "--max-output", "6", "--kv-memory-mib", "16"])
    steps = r["steps"]
    assert steps and any(s["prefill"] for s in steps) and any(s["decodes"] and not s["prefill"] for s in steps)
    # every request's output tokens after the first are decoded in some step (the first comes from its prefill)
    assert sum(s["decodes"] for s in steps) == r["output_tokens"] - 3
    assert r["weight_bytes"] > 0 and r["bandwidth_gb_s"] > 0 and r["gemm_gflops"] > 0
    printed = capsys.readouterr().out
    assert "| prefill (+ decodes riding along) |" in printed and "| decode batch" in printed
