"""The worker-facing handle: one job's spans, metrics and outcome line through every path."""

from __future__ import annotations

import logging

from prometheus_client.parser import text_string_to_metric_families

from qworker.telemetry.job import Telemetry
from qworker.telemetry.metrics import WorkerMetrics

from .conftest import fake_metrics, fake_output


def _jobs(m: WorkerMetrics) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render()[0].decode()):
        for s in fam.samples:
            if s.name == "qworker:jobs_total":
                out[(s.labels["outcome"], s.labels["code"])] = s.value
    return out


def test_completed_job(tracing, exporter, caplog):
    metrics = WorkerMetrics("smol")
    t = Telemetry(tracing, metrics, group_id="g", model="smol")
    j = t.job("job-1", "jobs", 0, 5, b"job-1", None, received_at=1000.0)
    j.queued()
    j.generating("text_completion", {"max_tokens": 2}, stream=True)
    m = fake_metrics(1000.5, first_scheduled_time=1000.6, first_token_time=1000.7)
    j.on_output(fake_output([1], m))
    m.finished_time = 1000.9
    last = fake_output([2], m, "length")
    j.on_output(last)
    assert dict(j.stream_headers())["traceparent"]
    j.generated(last, finish_reasons=["length"], input_tokens=3, output_tokens=2)
    with j.publish("completions") as headers:
        assert dict(headers)["traceparent"]
    with caplog.at_level(logging.INFO, logger="qworker.jobs"):
        j.outcome("completed", output_tokens=2)
        j.outcome("completed")  # once only
    names = [s.name for s in exporter.get_finished_spans()]
    assert sorted(names) == ["admission wait", "generate", "process jobs", "publish"]
    assert _jobs(metrics) == {("completed", ""): 1}
    (rec,) = [r for r in caplog.records if r.msg == "job finished"]
    assert rec.job_id == "job-1" and rec.outcome == "completed" and rec.output_tokens == 2


def test_rejected_abandoned_and_dead_lettered(tracing, exporter):
    metrics = WorkerMetrics("smol")
    t = Telemetry(tracing, metrics, group_id="g", model="smol")
    t.job("bad", "jobs", 0, 1, b"bad", None).outcome("error", "prompt_too_long")
    j = t.job("gone", "jobs", 1, 2, b"gone", None)
    j.queued()
    j.generating("chat", {"max_tokens": 2})
    j.outcome("abandoned")
    t.dead_letter("jobs", 2, 3, b"\x00", None, "not_json")
    assert _jobs(metrics) == {("error", "prompt_too_long"): 1, ("abandoned", ""): 1, ("dlq", "not_json"): 1}
    spans = exporter.get_finished_spans()
    assert sum(s.name == "process jobs" for s in spans) == 3
    gen = next(s for s in spans if s.name == "generate")
    assert gen.status.status_code.name == "ERROR" and gen.attributes["gen_ai.operation.name"] == "chat"


def test_a_run_that_ends_with_an_engine_error_ends_its_generate_span_as_an_error(tracing, exporter):
    """helper-113: the generate span of a job answered with engine_error ended with status UNSET
    (only the process span said error)."""
    metrics = WorkerMetrics("smol")
    t = Telemetry(tracing, metrics, group_id="g", model="smol")
    j = t.job("broken", "jobs", 0, 1, b"broken", None)
    j.generating("text_completion", {"max_tokens": 4})
    last = fake_output([1], fake_metrics(1000.0), "abort")
    j.on_output(last)
    j.generated(last, finish_reasons=["abort"], input_tokens=3, output_tokens=1, error="engine_error")
    j.outcome("error", "engine_error")
    gen = next(s for s in exporter.get_finished_spans() if s.name == "generate")
    assert gen.status.status_code.name == "ERROR" and gen.attributes["error.type"] == "engine_error"
    assert gen.attributes["gen_ai.usage.output_tokens"] == 1  # what it generated is still recorded
