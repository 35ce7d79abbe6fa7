"""A real job through the real broker and the real engine: its span tree, names and attributes,
the trace context on its result messages, the probes and the outcome log line."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from opentelemetry.trace import SpanKind

from qworker.messages import Job, Sampling, dumps
from qworker.telemetry.propagation import extract
from qworker.worker import Worker
from qworker.worker.client import cancel, producer_for

from .conftest import RawResults
from .test_http import get

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TP = f"00-{TRACE_ID}-{PARENT}-01"


async def produce(s, job: Job, headers: list[tuple[str, bytes]] | None = None) -> None:
    p = await producer_for(s)
    try:
        await p.send_and_wait(s.jobs_topic, dumps(job), key=job.id.encode(), headers=headers)
    finally:
        await p.stop()


def _span_id(headers) -> int:
    from opentelemetry import trace

    ctx = trace.get_current_span(extract(headers)).get_span_context()
    assert ctx.is_valid
    assert format(ctx.trace_id, "032x") == TRACE_ID
    return ctx.span_id


async def test_span_tree_of_a_real_job(real_engine, topics, raw_results: RawResults, tracing, exporter, caplog) -> None:
    eng, _ = real_engine
    s = topics.model_copy(update={"http_port": 0, "http_host": "127.0.0.1"})
    w = Worker(s, eng, tracing=tracing)
    await w.start()
    try:
        port = w.http.port
        job = Job(id="traced", messages=[{"role": "user", "content": "Name a colour."}], sampling=Sampling(max_tokens=6, temperature=0.0, top_p=0.9, seed=11), stream=True)
        with caplog.at_level(logging.INFO, logger="qworker.jobs"):
            await produce(s, job, [("traceparent", TP.encode()), ("tracestate", b"vendor=x")])
            await raw_results.wait(lambda: "traced" in raw_results.completions, 60, "the traced job")
            # the outcome is recorded right after the delivery ack: wait for it, however slow the machine
            await raw_results.wait(lambda: b'qworker:jobs_total{code="",model_name=' in w.metrics.render()[0], 20, "the outcome recorded")
        assert raw_results.completions["traced"][0]["type"] == "completion"

        # probes while serving
        status, _, body = await get(port, "/readyz")
        assert status == 200, body
        assert json.loads(body)["checks"] == {"model_loaded": True, "warmed_up": True, "in_group": True, "not_draining": True}
        assert (await get(port, "/healthz"))[0] == 200
        status, _, body = await get(port, "/metrics")
        assert status == 200 and b'qworker:jobs_total{code="",model_name=' in body and b"qworker:time_to_first_token_seconds_bucket" in body
    finally:
        await w.stop()

    spans = {sp.name: sp for sp in exporter.get_finished_spans() if sp.context.trace_id == int(TRACE_ID, 16)}
    process_name = f"process {s.jobs_topic}"
    assert set(spans) == {process_name, "admission wait", "generate", "publish"}
    proc = spans[process_name]
    assert proc.kind is SpanKind.CONSUMER and proc.parent.span_id == int(PARENT, 16)
    a = proc.attributes
    assert a["messaging.system"] == "kafka" and a["messaging.destination.name"] == s.jobs_topic
    assert a["messaging.consumer.group.name"] == s.group_id and a["messaging.kafka.message.key"] == "traced"
    assert a["messaging.operation.type"] == "process" and isinstance(a["messaging.kafka.offset"], int)
    assert a["messaging.destination.partition.id"] in {"0", "1", "2", "3"}
    assert a["qworker.job.outcome"] == "completed"
    for name in ("admission wait", "generate", "publish"):
        assert spans[name].parent.span_id == proc.context.span_id
    adm, gen, pub = spans["admission wait"], spans["generate"], spans["publish"]
    assert proc.start_time <= adm.start_time <= adm.end_time <= gen.start_time < gen.end_time <= pub.start_time <= pub.end_time <= proc.end_time
    g = gen.attributes
    assert (g["gen_ai.operation.name"], g["gen_ai.request.model"], g["gen_ai.response.model"]) == ("chat", w.model_name, w.model_name)
    assert (g["gen_ai.request.max_tokens"], g["gen_ai.request.temperature"], g["gen_ai.request.top_p"], g["gen_ai.request.seed"]) == (6, 0.0, 0.9, 11)
    assert g["gen_ai.request.stream"] is True and g["gen_ai.response.id"] == "traced"
    done = raw_results.completions["traced"][0]
    assert tuple(g["gen_ai.response.finish_reasons"]) == (done["choices"][0]["finish_reason"],)
    assert g["gen_ai.usage.input_tokens"] == done["usage"]["prompt_tokens"]
    assert g["gen_ai.usage.output_tokens"] == done["usage"]["completion_tokens"] > 0
    assert g["gen_ai.usage.cache_read.input_tokens"] == done["usage"]["cached_tokens"]
    assert 0 < g["gen_ai.response.time_to_first_chunk"] < 60 and g["qworker.queue_time"] >= 0 and g["qworker.preemptions"] == 0
    assert [e.name for e in gen.events] == ["first_token"]
    assert pub.kind is SpanKind.PRODUCER and pub.attributes["messaging.destination.name"] == s.completions_topic

    # result messages continue the trace: the completion from the publish span, deltas from the job span
    [completion_rec] = raw_results.raw[(s.completions_topic, "traced")]
    assert _span_id(completion_rec.headers) == pub.context.span_id
    deltas = raw_results.raw[(s.tokens_topic, "traced")]
    assert deltas and all(_span_id(r.headers) == proc.context.span_id for r in deltas)

    # one JSON-able outcome line, inside the job's trace
    [line] = [r for r in caplog.records if r.msg == "job finished" and getattr(r, "job_id", None) == "traced"]
    assert line.outcome == "completed" and line.output_tokens == done["usage"]["completion_tokens"]


async def test_cancel_in_flight_leaves_an_abort_event(real_engine, topics, raw_results: RawResults, tracing, exporter) -> None:
    eng, _ = real_engine
    w = Worker(topics, eng, tracing=tracing)
    await w.start()
    try:
        job = Job(id="to-cancel", prompt="Count slowly:", sampling=Sampling(max_tokens=200, temperature=0.0, ignore_eos=True), stream=True)
        await produce(topics, job)
        await raw_results.wait(lambda: raw_results.deltas.get("to-cancel"), 60, "the first delta")
        await cancel(topics, "to-cancel")
        await raw_results.wait(lambda: "to-cancel" in raw_results.completions, 60, "the cancelled completion")
        # the outcome is recorded right after the delivery ack: wait for it, however slow the machine
        await raw_results.wait(lambda: b'outcome="cancelled"' in w.metrics.render()[0], 20, "the outcome recorded")
        assert raw_results.completions["to-cancel"][0]["status"] == "cancelled"
        body = w.metrics.render()[0].decode()
        assert f'qworker:jobs_total{{code="",model_name="{w.model_name}",outcome="cancelled"}} 1.0' in body
    finally:
        await w.stop()
    gen = next(sp for sp in exporter.get_finished_spans() if sp.name == "generate")
    names = [e.name for e in gen.events]
    assert names[0] == "first_token" and names[-1] == "abort"
    assert gen.events[-1].attributes["qworker.abort.reason"] == "cancelled"
    proc = next(sp for sp in exporter.get_finished_spans() if sp.name.startswith("process "))
    assert proc.attributes["qworker.job.outcome"] == "cancelled" and not proc.parent  # no producer context: a root span
