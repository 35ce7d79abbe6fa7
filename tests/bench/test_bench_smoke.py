"""Smoke tests for the bench scripts: each runs end to end on the tiny random-weight model with a
tiny configuration and writes JSON with sane fields (the figures themselves are not checked)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402


def _json(out: Path, name: str) -> dict:
    files = sorted(out.glob(f"{name}-*.json"))
    assert len(files) == 1, files
    data = json.loads(files[0].read_text())
    assert data["commit"] and data["date"] and data["machine"] and data["command"]
    assert (out / files[0].name.replace(".json", ".png")).exists()
    return data


def test_percentile_and_table():
    xs = [float(i) for i in range(1, 101)]
    assert report.percentile(xs, 50) == pytest.approx(50.5)
    assert report.percentile(xs, 99) == pytest.approx(99.01)
    assert math.isnan(report.percentile([], 50))
    s = report.summary([3.0, None, 1.0, 2.0])
    assert s["n"] == 3 and s["mean"] == pytest.approx(2.0) and s["p50"] == pytest.approx(2.0)
    t = report.table(["a", "b"], [["x", 1.234], ["y", 123.4]])
    assert t.splitlines()[1] == "|---|---:|" and "| x | 1.23 |" in t and "| y | 123 |" in t


def test_throughput(tiny_model_dir, tmp_path, capsys):
    from bench import throughput

    r = throughput.main(["--model", str(tiny_model_dir), "--num-requests", "6", "--max-output", "12", "--kv-memory-mib", "8", "--budget-kv-mib", "1",
                         "--hf-single-sample", "2", "--decode-batches", "2,4", "--out", str(tmp_path)])
    assert r == _json(tmp_path, "throughput")
    assert r["workload"]["requests"] == 6
    main, budget = r["engine"], r["engine_kv_budget"]
    for run in (main, budget):
        assert run["useful_tokens"] == r["workload"]["useful_output_tokens"] and run["tokens_per_s"] > 0
        assert 0.5 < run["kv_slot_utilization"] <= 1.0 and run["peak_kv_blocks"] <= run["kv_blocks_total"]
    assert budget["kv_blocks_total"] < main["kv_blocks_total"]
    assert [d["batch"] for d in r["decode_vs_ceiling"]] == [2, 4]
    assert all(d["fraction"] == pytest.approx(d["decode_tokens_per_s"] / d["matmul_ceiling_tokens_per_s"]) for d in r["decode_vs_ceiling"])
    base = r["baselines"]
    assert set(base) == {"hf_one_at_a_time", "hf_static_batch_16", "hf_static_batch_32", "hf_static_same_kv_budget"}
    assert base["hf_static_same_kv_budget"]["engine_ratio"] == pytest.approx(budget["tokens_per_s"] / base["hf_static_same_kv_budget"]["tokens_per_s"])
    assert base["hf_one_at_a_time"]["engine_ratio"] == pytest.approx(main["tokens_per_s"] / base["hf_one_at_a_time"]["tokens_per_s"])
    assert "| qworker engine | 8 MiB |" in capsys.readouterr().out


def test_prefix_reuse(tiny_model_dir, tmp_path, capsys):
    from bench import prefix_reuse

    prefix_reuse.main(["--model", str(tiny_model_dir), "--quick", "--rate", "50", "--no-burst", "--out", str(tmp_path)])
    r = _json(tmp_path, "prefix_reuse")
    on, off = r["scenarios"]["steady"]["on"], r["scenarios"]["steady"]["off"]
    assert off["counters"]["prompt_tokens_cached"] == 0
    assert off["counters"]["prompt_tokens_computed"] == r["workload"]["prompt_tokens"]
    assert 0 < on["counters"]["prompt_tokens_cached"] <= r["workload"]["reusable_shared_tokens"]
    assert on["counters"]["prompt_tokens_computed"] + on["counters"]["prompt_tokens_cached"] == r["workload"]["prompt_tokens"]
    assert on["requests"] == off["requests"] == r["workload"]["requests"]
    assert all(x["ttft_s"]["p50"] > 0 and x["ttft_s"]["n"] == x["requests"] for x in (on, off))
    assert "| steady" in capsys.readouterr().out


def test_memory_pressure(tiny_model_dir, tmp_path):
    from bench import memory_pressure

    memory_pressure.main(["--model", str(tiny_model_dir), "--quick", "--context", "96", "--max-tokens", "32", "--no-ample", "--out", str(tmp_path)])
    r = _json(tmp_path, "memory_pressure")
    swap, rec = r["engine"]["swap"], r["engine"]["recompute"]
    assert r["workload"]["pool_blocks"] < r["workload"]["peak_need_blocks"]
    assert swap["preemptions_swap"] > 0 and swap["blocks_swapped_out"] > 0
    assert rec["preemptions_swap"] == 0 and rec["preemptions_recompute"] > 0 and rec["blocks_swapped_out"] == 0
    for x in (swap, rec):
        assert x["output_tokens"] == r["workload"]["useful_output_tokens"] and x["tokens_per_s"] > 0
        assert x["peak"]["kv_blocks_used"] <= x["kv_blocks_total"]
    assert rec["forward_tokens"] > swap["forward_tokens"]  # recomputation is visible


def test_parallel_sampling(tiny_model_dir, tmp_path):
    from bench import parallel_sampling

    parallel_sampling.main(["--model", str(tiny_model_dir), "--quick", "--num-prompts", "2", "--max-tokens", "6", "--out", str(tmp_path)])
    r = _json(tmp_path, "parallel_sampling")
    n4, ind = r["engine"]["n4"], r["engine"]["independent_uncached"]
    assert r["workload"]["useful_output_tokens"] == 2 * 4 * 6
    assert n4["output_tokens"] == ind["output_tokens"] == r["engine"]["independent_cached"]["output_tokens"] == 48
    assert n4["cow_copies"] > 0 and ind["cow_copies"] == 0
    assert n4["peak_kv_blocks"] < ind["peak_kv_blocks"]
    assert n4["prompt_tokens_computed"] == r["workload"]["prompt_tokens"]
    assert ind["prompt_tokens_computed"] == 4 * r["workload"]["prompt_tokens"]


def test_fairness(tiny_model_dir, tmp_path):
    from bench import fairness

    fairness.main(["--model", str(tiny_model_dir), "--quick", "--num-short", "3", "--long-prompt", "64", "--long-max-tokens", "12", "--short-rate", "20", "--out", str(tmp_path)])
    r = _json(tmp_path, "fairness")
    mixed, alone, longs = r["engine"]["mixed"], r["engine"]["shorts_alone"], r["engine"]["longs_alone"]
    assert mixed["short"]["requests"] == alone["short"]["requests"] == 3 and alone["long"]["requests"] == 0
    assert mixed["long"]["requests"] == longs["long"]["requests"] == 1 and longs["short"]["requests"] == 0
    assert mixed["long"]["output_tokens"] == longs["long"]["output_tokens"] == 12
    assert mixed["short"]["e2e_s"]["p99"] >= mixed["short"]["e2e_s"]["p50"] > 0
    assert r["compare"]["long_throughput_mixed_over_alone"] > 0


@pytest.mark.slow
def test_gemm_paths(tiny_model_dir, tmp_path, capsys):
    from bench import gemm_paths

    r = gemm_paths.main(["--model", str(tiny_model_dir), "--quick", "--rows", "1,4", "--hints", "none,16", "--rounds", "1", "--out", str(tmp_path)])
    assert r == _json(tmp_path, "gemm_paths") | {"rows": r["rows"]}
    assert set(r["rows"]) == {1, 4}
    import torch

    from kernels import gemm_cpu

    want = {"x @ w", "F.linear", "oneDNN hint=None", "oneDNN hint=16"} | ({"panels"} if not gemm_cpu.self_check(torch.float32) else set())
    assert set(r["rows"][4]["ms"]) == want
    assert "| rows |" in capsys.readouterr().out


def test_greedy_head(model_dir, capsys):
    """Runs on the real head (its tokens are checked equal to the full head's every round)."""
    from bench import greedy_head

    rows = greedy_head.main(["--model", str(model_dir), "--rows", "1,3", "--rounds", "1"])
    assert [r["rows"] for r in rows] == [1, 3] and all(r["full_ms"] > 0 and r["bounded_ms"] > 0 for r in rows)
    assert "bounded/full" in capsys.readouterr().out
