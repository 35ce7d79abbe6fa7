"""Smoke tests for the bench scripts that go through the real broker and a real `qworker run`
process (the broker-bound group of tests/run_all.py; the CPU-bound ones are test_bench_smoke.py)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.test_bench_smoke import _json  # noqa: E402


def test_online(tiny_model_dir, tmp_path):
    """Through the real broker and a real `qworker run` process: 4 jobs, one rate."""
    from bench import online

    online.main(
        ["--model", str(tiny_model_dir), "--quick", "--capacity", "4", "--rates", "0.5", "--target-fraction", "0.5", "--min-requests", "4", "--duration", "1", "--out", str(tmp_path)]
    )
    r = _json(tmp_path, "online")
    (run,) = r["kafka"]
    assert run["jobs"] == run["completed"] == 4
    assert run["lost"] == run["duplicated"] == run["stream_mismatch"] == 0 and run["errors"] == []
    assert 0 < run["ttft_s"]["p50"] <= run["e2e_s"]["p50"]
    assert run["output_tokens_per_s"] > 0 and run["worker_ttft_s"]["n"] == 4
    assert r["worker_exit_code"] == 0
    assert r["target"]["engine_ttft_p50_s"] > 0 and r["engine_at_target"]["requests"] == 4


def test_worker_saturated(tiny_model_dir):
    """Every job at once through the real broker and a real `qworker run`, against the engine
    alone in its own process: both sides' tokens agree, each job answered once, CPU counted."""
    from bench import worker_saturated

    r = worker_saturated.main(["--model", str(tiny_model_dir), "--quick", "--kv-memory-mib", "64"])
    (run,) = r["rounds"]
    assert run["completed"] == 4 and run["lost"] == run["duplicated"] == run["errors"] == run["stream_mismatch"] == 0
    assert run["tokens_differ"] == 0
    assert run["kafka_tokens_per_s"] > 0 and run["engine_tokens_per_s"] > 0
    assert all(run["cpu_s"][k] > 0 for k in ("worker", "engine alone", "broker"))
