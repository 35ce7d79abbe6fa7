"""bench/kernel_bench.py must run end to end before it reaches a GPU: its
``--dry-run`` mode takes every code path on tiny shapes under the interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="bench/gpu_check.sh runs the real benchmark on CUDA")
def test_kernel_bench_dry_run(tmp_path):
    out = tmp_path / "kb.json"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_bench.py"), "--dry-run", "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    data = json.loads(out.read_text())
    kinds = {r["kernel"] for r in data["rows"]}
    assert {"decode:default", "decode:best", "prefill", "decode:window", "prefill:window", "store_kv", "rms_norm",
            "lora:shrink", "lora:expand"} <= kinds
    assert data["accuracy_ok"] and data["copy"]["GBps"] > 0
    assert "decode:best" in res.stdout  # the table is printed last
