"""bench/moe_engine.py runs end to end on a tiny random MoE and reports both paths (the figures
themselves are not checked; the outputs of the two paths must be identical)."""

from __future__ import annotations

import json


def test_moe_engine_bench_smoke(tmp_path, model_dir, monkeypatch):
    from bench import moe_engine

    monkeypatch.delenv("QWORKER_CPU_MOE_KERNEL", raising=False)
    r = moe_engine.main(["--model", str(model_dir), "--hidden", "64", "--layers", "2", "--experts", "4", "--top-k", "2",
                         "--expert-inter", "32", "--requests", "3", "--max-tokens", "4", "--quick", "--out", str(tmp_path)])
    [f] = tmp_path.glob("moe-engine-*.json")
    assert json.loads(f.read_text())["tokens_per_s"] == r["tokens_per_s"]
    assert set(r["tokens_per_s"]) == {"one call", "grouped"} and all(len(v) == 2 and min(v) > 0 for v in r["tokens_per_s"].values())
    assert r["identical_outputs"] is True
