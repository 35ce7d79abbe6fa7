"""qworker:* metrics: the engine stats collector, request histograms, job outcomes, lag."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qworker.telemetry.metrics import MAX_CODES, WorkerMetrics

from .conftest import fake_metrics

STATS = {
    "kv_blocks_total": 100,
    "kv_usage": 0.25,
    "cpu_swap_blocks_total": 40,
    "cpu_swap_blocks_used": 10,
    "prefix_cache_queries": 64,
    "prefix_cache_hits": 32,
    "preemptions_swap": 2,
    "preemptions_recompute": 1,
    "blocks_swapped_out": 6,
    "blocks_swapped_in": 4,
    "blocks_evicted": 3,
    "num_running": 5,
    "num_waiting": 2,
    "num_swapped": 1,
    "prompt_tokens_computed": 500,
    "prompt_tokens_cached": 32,
    "generation_tokens": 77,
    "steps": 9,
}


def samples(m: WorkerMetrics) -> dict[tuple[str, tuple], float]:
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def test_engine_stats_become_gauges_and_counters():
    stats = dict(STATS)
    m = WorkerMetrics("smol", stats=lambda: stats)
    s = samples(m)
    assert s[("qworker:num_requests_running", ())] == 5
    assert s[("qworker:num_requests_waiting", ())] == 2
    assert s[("qworker:num_requests_swapped", ())] == 1
    assert s[("qworker:kv_cache_usage_perc", ())] == 0.25
    assert s[("qworker:cpu_swap_usage_perc", ())] == 0.25
    assert s[("qworker:prefix_cache_queries_total", ())] == 64
    assert s[("qworker:prefix_cache_hits_total", ())] == 32
    assert s[("qworker:num_preemptions_total", (("mode", "swap"),))] == 2
    assert s[("qworker:num_preemptions_total", (("mode", "recompute"),))] == 1
    assert s[("qworker:blocks_swapped_total", (("direction", "out"),))] == 6
    assert s[("qworker:blocks_swapped_total", (("direction", "in"),))] == 4
    assert s[("qworker:blocks_evicted_total", ())] == 3
    assert s[("qworker:prompt_tokens_total", (("source", "computed"),))] == 500
    assert s[("qworker:prompt_tokens_total", (("source", "cached"),))] == 32
    assert s[("qworker:generation_tokens_total", ())] == 77
    stats["generation_tokens"] = 80  # cumulative engine counters move the exposed counters
    assert samples(m)[("qworker:generation_tokens_total", ())] == 80


def test_structured_output_stats_are_exported():
    stats = {**STATS, "grammar_compilations": 3, "grammar_cache_hits": 5, "grammar_compile_seconds": 0.5, "mask_seconds": 0.25, "num_compiling": 1}
    s = samples(WorkerMetrics("smol", stats=lambda: stats))
    assert s[("qworker:grammar_compilations_total", ())] == 3
    assert s[("qworker:grammar_cache_hits_total", ())] == 5
    assert s[("qworker:grammar_compile_seconds_total", ())] == 0.5
    assert s[("qworker:structured_mask_seconds_total", ())] == 0.25
    assert s[("qworker:num_requests_compiling", ())] == 1


def test_speculative_decoding_stats_are_exported():
    stats = {**STATS, "spec_decode_num_drafts": 4, "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 7,
             "spec_decode_num_accepted_tokens_per_pos": [4, 2, 1]}
    s = samples(WorkerMetrics("smol", stats=lambda: stats))
    assert s[("qworker:spec_decode_num_drafts_total", ())] == 4
    assert s[("qworker:spec_decode_num_draft_tokens_total", ())] == 12
    assert s[("qworker:spec_decode_num_accepted_tokens_total", ())] == 7
    assert [s[("qworker:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))] for i in range(3)] == [4, 2, 1]
    off = samples(WorkerMetrics("smol", stats=lambda: STATS))  # speculation off: zeros, no positions
    assert off[("qworker:spec_decode_num_drafts_total", ())] == 0
    assert not any(k[0] == "qworker:spec_decode_num_accepted_tokens_per_pos_total" for k in off)


def test_engine_not_up_yet_still_scrapes():
    def broken():
        raise RuntimeError("no engine")

    m = WorkerMetrics("smol", stats=broken)
    s = samples(m)
    assert not any(name.startswith("qworker:num_requests_running") for name, _ in s)
    m.attach_engine(lambda: STATS)  # replacing the source does not duplicate families
    assert samples(m)[("qworker:num_requests_running", ())] == 5


def test_observe_request_fills_histograms():
    m = WorkerMetrics("smol")
    rm = fake_metrics(100.0, first_scheduled_time=100.5, first_token_time=101.0, finished_time=103.0)
    m.observe_request(rm, 4, num_prompt_tokens=10, start_time=99.0)
    timer = m.request_timer()
    for t in (1.0, 1.1, 1.3):
        timer.on_output(1, now=t)
    timer.on_output(0, now=9.0)  # held-back text without tokens: not a token gap
    s = samples(m)
    assert s[("qworker:time_to_first_token_seconds_sum", ())] == pytest.approx(2.0)
    assert s[("qworker:request_queue_time_seconds_sum", ())] == pytest.approx(1.5)
    assert s[("qworker:e2e_request_latency_seconds_sum", ())] == pytest.approx(4.0)
    assert s[("qworker:inter_token_latency_seconds_count", ())] == 2
    assert s[("qworker:inter_token_latency_seconds_sum", ())] == pytest.approx(0.3)
    assert s[("qworker:request_generation_tokens_sum", ())] == 4
    assert s[("qworker:request_prompt_tokens_sum", ())] == 10
    # clock skew: a start after the engine's stamps counts as zero, never negative
    m.observe_request(fake_metrics(100.0, first_token_time=100.1, finished_time=100.2), 1, start_time=200.0)
    assert samples(m)[("qworker:time_to_first_token_seconds_sum", ())] == pytest.approx(2.0)


def test_job_outcomes_and_bounded_codes():
    m = WorkerMetrics("smol")
    m.job_outcome("completed")
    m.job_outcome("completed")
    m.job_outcome("cancelled")
    m.job_outcome("dlq", "not_json")
    m.job_outcome("error", "prompt_too_long")
    m.job_outcome("error", "Bad Code!")
    for i in range(MAX_CODES + 5):
        m.job_outcome("error", f"code_{i}")
    with pytest.raises(ValueError):
        m.job_outcome("done")
    s = samples(m)
    jobs = {k[1]: v for k, v in s.items() if k[0] == "qworker:jobs_total"}
    assert jobs[(("code", ""), ("outcome", "completed"))] == 2
    assert jobs[(("code", ""), ("outcome", "cancelled"))] == 1
    assert jobs[(("code", "not_json"), ("outcome", "dlq"))] == 1
    assert jobs[(("code", "prompt_too_long"), ("outcome", "error"))] == 1
    codes = {dict(k)["code"] for k in jobs}
    assert len(codes) <= MAX_CODES + 2  # "" and "other" on top of the cap
    assert jobs[(("code", "other"), ("outcome", "error"))] >= 6


def test_consumer_lag_per_owned_partition():
    m = WorkerMetrics("smol")
    m.set_consumer_lag("jobs", 0, 5)
    m.set_consumer_lag("jobs", 1, -2)  # committed past a stale high watermark: clamp
    s = samples(m)
    assert s[("qworker:consumer_lag", (("partition", "0"), ("topic", "jobs")))] == 5
    assert s[("qworker:consumer_lag", (("partition", "1"), ("topic", "jobs")))] == 0
    m.retain_consumer_lag({("jobs", 1)})  # partition 0 was revoked
    s = samples(m)
    assert ("qworker:consumer_lag", (("partition", "0"), ("topic", "jobs"))) not in s
    assert ("qworker:consumer_lag", (("partition", "1"), ("topic", "jobs"))) in s


def test_openmetrics_negotiation():
    body, ctype = WorkerMetrics("smol").render("application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text") and body.rstrip().endswith(b"# EOF")
