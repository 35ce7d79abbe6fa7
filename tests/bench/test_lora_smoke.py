"""bench/lora.py: its adapters are real PEFT folders (cached, B non-zero), and a tiny run on the tiny
random-weight model writes JSON (and the PNG) with every mode's figures; the figures themselves are
not checked, only that adapter requests were really run under their adapters."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def test_adapters_are_peft_folders_made_once(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from bench import lora

    paths = lora.make_adapters(str(tiny_model_dir), tmp_path, 2, 8, seed=3)
    assert len(paths) == 2 and paths[0] != paths[1]
    for p in paths:
        cfg = json.loads((p / "adapter_config.json").read_text())
        assert cfg["r"] == 8 and sorted(cfg["target_modules"]) == sorted(lora.ALL_MODULES)
        tensors = load_file(str(p / "adapter_model.safetensors"))
        b = [t for name, t in tensors.items() if "lora_B" in name]
        assert len(b) == 2 * 7 and all(t.abs().sum() > 0 for t in b)  # 2 layers x 7 projections
    stamp = (paths[0] / "adapter_model.safetensors").stat().st_mtime_ns
    assert lora.make_adapters(str(tiny_model_dir), tmp_path, 2, 8, seed=3) == paths
    assert (paths[0] / "adapter_model.safetensors").stat().st_mtime_ns == stamp  # reused, not remade


def test_lora_bench_runs(tiny_model_dir, tmp_path, capsys):
    from bench import lora

    r = lora.main(["--model", str(tiny_model_dir), "--adapters", "1,2", "--requests", "4", "--rounds", "1",
                   "--max-tokens", "4,6", "--rank", "8", "--kv-memory-mib", "8", "--out", str(tmp_path)])
    (path,) = sorted(tmp_path.glob("lora-*.json"))
    assert json.loads(path.read_text())["modes"] == json.loads(json.dumps(r["modes"]))
    assert path.with_suffix(".png").exists()
    assert r["commit"] and r["machine"] and r["command"]
    assert [m["mode"] for m in r["modes"]] == ["base", "base, LoRA engine", "1 adapter", "2 adapters"]
    for m in r["modes"]:
        assert len(m["tokens_per_s"]) == 1 and m["median_tokens_per_s"] > 0
        assert m["ratio_vs_base"] == pytest.approx(m["median_tokens_per_s"] / r["modes"][0]["median_tokens_per_s"])
        assert m["median_tokens_per_cpu_s"] > 0
        assert m["cpu_ratio_vs_base"] == pytest.approx(m["median_tokens_per_cpu_s"] / r["modes"][0]["median_tokens_per_cpu_s"])
    by = {m["mode"]: m for m in r["modes"]}
    assert by["base, LoRA engine"]["outputs_differ_from_base"] == 0.0  # no adapter: the base model's tokens
    assert by["2 adapters"]["outputs_differ_from_base"] > 0  # the adapters really ran
    assert "target_4_adapters_ratio" not in r
    assert "| 2 adapters |" in capsys.readouterr().out
