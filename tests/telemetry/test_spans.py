"""The job span tree, its attributes and the generate span's events, with an in-memory exporter."""

from __future__ import annotations

from types import SimpleNamespace

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from qworker.engine.outputs import EV_PREEMPT_RECOMPUTE, EV_PREEMPT_SWAP, EV_SWAP_IN

from qworker.telemetry import genai
from qworker.telemetry.propagation import extract
from qworker.telemetry.spans import JobTracer
from qworker.telemetry.tracing import disabled

from .conftest import fake_metrics, fake_output

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
SAMPLING = {"max_tokens": 8, "temperature": 0.0, "top_p": 0.9, "top_k": 0, "seed": 7, "n": 1, "stop": ["\n"]}


def _by_name(exporter):
    return {s.name: s for s in exporter.get_finished_spans()}


def test_job_span_tree(tracing, exporter):
    jt = JobTracer(tracing, group_id="g1", model="smollm2-135m").start_job("jobs", 3, 42, b"job-1", [("traceparent", TP.encode())])
    jt.admission().end()
    gen = jt.generation(genai.operation_name([{"role": "user", "content": "hi"}]), SAMPLING, stream=True)
    m = fake_metrics(100.0, first_scheduled_time=100.25)
    gen.on_output(fake_output([], m))  # held-back text, no tokens yet: no first_token event
    m.first_token_time = 100.5
    gen.on_output(fake_output([5, 6], m))
    m.finished_time = 101.0
    final = fake_output([7], m, "stop")
    gen.on_output(final)
    gen.finish(final, finish_reasons=["stop"], input_tokens=10, output_tokens=3, cached_tokens=4, response_id="job-1")
    with jt.publish("completions") as headers:
        sent = list(headers)
    jt.end("completed")

    spans = _by_name(exporter)
    assert set(spans) == {"process jobs", "admission wait", "generate", "publish"}
    process = spans["process jobs"]
    assert process.kind is SpanKind.CONSUMER
    assert format(process.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert process.parent.span_id == 0xB7AD6B7169203331 and process.parent.is_remote
    assert dict(process.attributes) == {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": "jobs",
        "messaging.destination.partition.id": "3",
        "messaging.kafka.offset": 42,
        "messaging.consumer.group.name": "g1",
        "messaging.kafka.message.key": "job-1",
        "qworker.job.outcome": "completed",
    }
    for name in ("admission wait", "generate", "publish"):
        assert spans[name].parent.span_id == process.context.span_id
        assert spans[name].context.trace_id == process.context.trace_id
    g = spans["generate"]
    assert g.attributes["gen_ai.operation.name"] == "chat"
    assert g.attributes["gen_ai.request.model"] == "smollm2-135m"
    assert g.attributes["gen_ai.request.max_tokens"] == 8
    assert g.attributes["gen_ai.request.temperature"] == 0.0
    assert g.attributes["gen_ai.request.top_p"] == 0.9
    assert g.attributes["gen_ai.request.seed"] == 7
    assert g.attributes["gen_ai.request.stream"] is True
    assert tuple(g.attributes["gen_ai.request.stop_sequences"]) == ("\n",)
    assert "gen_ai.request.choice.count" not in g.attributes  # n == 1
    assert tuple(g.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    assert g.attributes["gen_ai.usage.input_tokens"] == 10
    assert g.attributes["gen_ai.usage.output_tokens"] == 3
    assert g.attributes["gen_ai.usage.cache_read.input_tokens"] == 4
    assert g.attributes["gen_ai.response.id"] == "job-1"
    assert g.attributes["gen_ai.response.time_to_first_chunk"] == 0.5
    assert g.attributes["qworker.queue_time"] == 0.25
    assert g.attributes["qworker.preemptions"] == 0
    assert not any(k.startswith("gen_ai.system") or "prompt_tokens" in k or "completion_tokens" in k for k in g.attributes)
    assert [e.name for e in g.events] == ["first_token"]
    assert g.events[0].timestamp == int(100.5e9)
    pub = spans["publish"]
    assert pub.kind is SpanKind.PRODUCER and pub.attributes["messaging.destination.name"] == "completions"
    assert trace.get_current_span(extract(sent)).get_span_context().span_id == pub.context.span_id


def test_preemption_swap_and_abort_events(tracing, exporter):
    """The engine's ``metrics.events`` become span events with its timestamps and exact modes,
    each entry once, whether it shows on a delta or only at ``finish``."""
    jt = JobTracer(tracing, group_id="g", model="m").start_job("jobs", 0, 1, None, None)
    gen = jt.generation("text_completion", SimpleNamespace(max_tokens=8, n=2))
    m = fake_metrics(first_token_time=100.1)
    gen.on_output(fake_output([1], m))
    m.events += [(100.2, EV_PREEMPT_SWAP, 1), (100.3, EV_SWAP_IN, 1)]  # while it emitted nothing
    gen.on_output(fake_output([2], m))
    gen.on_output(fake_output([3], m))  # nothing new: no event twice
    m.events.append((100.4, EV_PREEMPT_RECOMPUTE, 0))
    m.num_preemptions = 2
    m.events.append((100.5, EV_PREEMPT_SWAP, 0))  # after the last delta: seen by finish
    m.num_preemptions = 3
    gen.abort("cancelled")
    gen.finish(fake_output([], m, "abort"), finish_reasons=["abort"], input_tokens=3, output_tokens=3)
    gen.fail("ignored: already ended")
    jt.end("cancelled")
    g = _by_name(exporter)["generate"]
    events = [
        (e.name, e.timestamp, e.attributes.get("qworker.choice.index"), e.attributes.get("qworker.preemption.mode"), e.attributes.get("qworker.preemption.count"))
        for e in g.events
    ]
    assert events == [
        ("first_token", int(100.1e9), None, None, None),
        ("preemption", int(100.2e9), 1, "swap", 1),
        ("swap_out", int(100.2e9), 1, None, None),
        ("swap_in", int(100.3e9), 1, None, None),
        ("abort", events[4][1], None, None, None),
        ("preemption", int(100.4e9), 0, "recompute", 2),
        ("preemption", int(100.5e9), 0, "swap", 3),
        ("swap_out", int(100.5e9), 0, None, None),
    ]
    assert g.attributes["qworker.preemptions"] == 3
    assert g.status.status_code is StatusCode.UNSET
    assert jt.span.attributes["qworker.job.outcome"] == "cancelled"


def test_error_outcome_sets_status(tracing, exporter):
    jt = JobTracer(tracing, group_id="g", model="m").start_job("jobs", 0, 1, b"\xff", None)
    gen = jt.generation("text_completion", SimpleNamespace(max_tokens=4, temperature=1.0, top_p=1.0, n=2, seed=None))
    gen.fail(RuntimeError("boom"))
    jt.end("error", code="engine_error")
    spans = _by_name(exporter)
    assert spans["generate"].status.status_code is StatusCode.ERROR
    assert spans["generate"].events[0].name == "exception"
    assert spans["generate"].attributes["gen_ai.request.choice.count"] == 2
    p = spans["process jobs"]
    assert p.status.status_code is StatusCode.ERROR and p.attributes["error.type"] == "engine_error"
    assert "messaging.kafka.message.key" not in p.attributes  # not valid UTF-8


def test_disabled_tracing_is_inert():
    jt = JobTracer(disabled(), group_id="g", model="m").start_job("jobs", 0, 1, b"k", [("traceparent", TP.encode())])
    assert not jt.recording
    gen = jt.generation("chat", SAMPLING)
    assert not gen.recording
    gen.on_output(fake_output([1], fake_metrics(first_token_time=1.0, events=[(1.0, EV_PREEMPT_SWAP, 0)])))
    gen.finish(None, finish_reasons=["stop"], input_tokens=1, output_tokens=1)
    with jt.publish("completions") as headers:
        assert dict(headers)["traceparent"].decode() == TP  # passes through
    jt.end("completed")
    assert gen._events_seen == 0  # nothing recorded, the engine's events not even read


def test_a_record_key_enters_its_span_bounded(tracing, exporter):
    """helper-54: a megabyte key was copied whole into its span; 2,048 such spans queued behind a
    stalled collector held over 500 MB. The key is for finding the record: cut to 256 characters."""
    from qworker.telemetry.spans import MAX_KEY_CHARS

    for key in (b"k" * 1_000_000, "é" * 100_000, b"\xc3\xa9" * 300_000, b"short-key"):
        jt = JobTracer(tracing, group_id="g", model="m").start_job("jobs", 0, 1, key, [])
        jt.end("completed")
    got = [s.attributes.get("messaging.kafka.message.key") for s in exporter.get_finished_spans() if s.name == "process jobs"]
    assert len(got) == 4 and all(len(k) <= MAX_KEY_CHARS for k in got)
    assert got[3] == "short-key" and got[1].startswith("é" * 200) and got[2].startswith("é" * 200)
    # a key that is not text is left out however long it is (helper-55: past 1 KiB its bad bytes were dropped)
    from qworker.telemetry.spans import _key_text

    for binary in (b"\xff" * 1025, bytes(range(256)) * 8, b"\xff" + b"a" * 2000, b"\xff"):
        assert _key_text(binary) is None, binary[:8]
    assert _key_text("a" * MAX_KEY_CHARS) == "a" * MAX_KEY_CHARS and len(_key_text("a" * (MAX_KEY_CHARS + 1))) == MAX_KEY_CHARS


def test_the_tracing_stop_is_bounded_when_the_collector_never_answers():
    """helper-54: the SDK's shutdown waited on a collector that accepted and never answered for
    ~30 s (every queued batch at the exporter's timeout), past the pod's grace period."""
    import threading
    import time

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from qworker.telemetry.tracing import from_provider

    never = threading.Event()

    class Hanging(SpanExporter):
        def export(self, spans):
            never.wait(60)
            return SpanExportResult.FAILURE

    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(Hanging(), schedule_delay_millis=10))
    t = from_provider(provider)
    for _ in range(600):
        t.tracer.start_span("x").end()
    try:
        for stop in (t.flush, t.shutdown):
            t0 = time.monotonic()
            stop(0.5)
            assert time.monotonic() - t0 < 3, stop
    finally:
        never.set()
