"""bench/fused_forward.py on the tiny model: both paths run on a prefill and on decode batches, and
their logits are checked equal (the script exits otherwise); the timings are for an idle machine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import fused_forward  # noqa: E402
from kernels import cpu as kcpu  # noqa: E402


@pytest.mark.skipif(not kcpu.cpu_kernels_available(), reason="no C compiler for the CPU kernels")
def test_fused_forward_small_run(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("QWORKER_CPU_LINEAR", "panels")  # the fused loop runs on the panels GEMM
    rows = fused_forward.main(["--model", str(tiny_model_dir), "--batches", "1,3", "--context", "20",
                               "--prefill-tokens", "40", "--rounds", "2"])
    assert [r["batch"] for r in rows] == ["prefill 40", "1", "3"]
    assert all(r["fused_ms"] > 0 and r["python_ms"] > 0 for r in rows)
    assert "python/fused" in capsys.readouterr().out
