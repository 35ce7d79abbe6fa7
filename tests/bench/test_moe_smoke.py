"""bench/moe.py runs end to end on a tiny MoE stack and writes sane JSON and a table (the figures
themselves are not checked)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kernels import cpu as kcpu

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def test_moe_bench_smoke(tmp_path, capsys):
    from bench import moe

    r = moe.main(["--hidden", "64", "--experts", "8", "--top-k", "2", "--expert-inter", "32", "--layers", "2",
                  "--rows", "1,4", "--prefill", "24", "--rounds", "2", "--out", str(tmp_path)])
    files = sorted(tmp_path.glob("moe-*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["cases"] == json.loads(json.dumps(r["cases"]))
    assert r["commit"] and r["machine"] and r["command"]
    assert r["shape"] == dict(hidden=64, experts=8, top_k=2, expert_inter=32, dense_inter=64, layers=2)
    assert [c["case"] for c in r["cases"]] == ["decode batch 1", "decode batch 4", "prefill 24"]
    for c in r["cases"]:
        # "moe grouped": the Python grouped path beside the one-call kernel, where the kernel runs
        assert set(c["tokens_per_s"]) - {"moe grouped"} == {"moe", "dense", "moe eager loop"}
        assert ("moe grouped" in c["tokens_per_s"]) == (r["linear_backend"] == "panels" and kcpu.cpu_kernels_available())
        assert all(v > 0 for v in c["tokens_per_s"].values())
        assert c["moe_vs_dense"] == pytest.approx(c["tokens_per_s"]["moe"] / c["tokens_per_s"]["dense"])
        assert 2 <= c["active_experts_layer0"] <= min(8, 2 * c["rows"])
    assert r["cases"][0]["active_experts_layer0"] == 2  # one token: exactly its top-2
    out = capsys.readouterr().out
    assert "| decode batch 1 | 2/8 |" in out and "moe / dense" in out and "experts hit per step" in out
