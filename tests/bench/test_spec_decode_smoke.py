"""Smoke test for bench/spec_decode.py: a tiny run on the tiny random-weight model writes JSON
(and the PNG) with one entry per level and every mode's figures (the figures are not checked)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def test_spec_decode_bench_shape(tiny_model_dir, tmp_path, capsys):
    from bench import spec_decode

    r = spec_decode.main(["--model", str(tiny_model_dir), "--concurrency", "1,3", "--jobs-per-level", "3", "--max-output", "10",
                          "--rounds", "1", "--kv-memory-mib", "8", "--out", str(tmp_path)])
    (path,) = sorted(tmp_path.glob("spec_decode-*.json"))
    assert json.loads(path.read_text())["levels"] == json.loads(json.dumps(r["levels"]))
    assert [lv["concurrency"] for lv in r["levels"]] == [1, 3]
    for lv in r["levels"]:
        assert lv["identical_outputs"] is True
        for m in ("off", "ngram", "auto"):
            assert lv[m]["tokens_per_s"] > 0 and lv[m]["output_tokens"] > 0
            assert 0.0 <= lv[m]["acceptance_rate"] <= 1.0
        assert lv["off"]["acceptance_rate"] == 0.0
        assert lv["ngram_ratio"] > 0 and lv["auto_ratio"] > 0
    assert "| concurrent |" in capsys.readouterr().out
