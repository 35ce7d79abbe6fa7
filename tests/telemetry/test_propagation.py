"""W3C trace context in aiokafka header lists."""

from __future__ import annotations

from opentelemetry import trace

from qworker.telemetry.propagation import extract, inject

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_extract_reads_traceparent_and_tracestate():
    ctx = extract([("other", b"x"), ("traceparent", TP.encode()), ("tracestate", b"vendor=1")])
    sc = trace.get_current_span(ctx).get_span_context()
    assert sc.is_valid and sc.is_remote
    assert format(sc.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(sc.span_id, "016x") == "b7ad6b7169203331"
    assert sc.trace_state.get("vendor") == "1"


def test_extract_is_case_insensitive_and_tolerates_junk():
    assert trace.get_current_span(extract([("TraceParent", TP.encode())])).get_span_context().is_valid
    for headers in (None, [], [("traceparent", None)], [("traceparent", b"garbage")], [("traceparent", b"\xff\xfe")]):
        assert not trace.get_current_span(extract(headers)).get_span_context().is_valid


def test_inject_replaces_existing_and_keeps_other_headers(tracing):
    parent = extract([("traceparent", TP.encode())])
    with tracing.tracer.start_as_current_span("child", context=parent) as span:
        headers = inject([("traceparent", b"stale"), ("k", b"v")])
    keys = [k for k, _ in headers]
    assert keys.count("traceparent") == 1 and ("k", b"v") in headers
    value = dict(headers)["traceparent"].decode()
    assert value.startswith("00-0af7651916cd43dd8448eb211c80319c-")
    assert value.split("-")[2] == format(span.get_span_context().span_id, "016x")
    # and it round-trips
    assert trace.get_current_span(extract(headers)).get_span_context().span_id == span.get_span_context().span_id


def test_inject_without_context_writes_nothing():
    assert inject() == []
    assert inject([("k", b"v")]) == [("k", b"v")]


def test_noop_tracer_passes_producer_context_through():
    """Tracing off: no spans, but result messages still carry the producer's traceparent."""
    tracer = trace.NoOpTracer()
    span = tracer.start_span("process jobs", context=extract([("traceparent", TP.encode())]))
    assert not span.is_recording()
    assert dict(inject(context=trace.set_span_in_context(span)))["traceparent"].decode() == TP


def test_a_long_tracestate_is_cut_as_w3c_says(tracing):
    """helper-82: an 8 KiB producer tracestate rode along on every answer, past the 1 KiB the
    answer's size check leaves for headers. What is passed on is now at most 512 characters:
    entries over 128 characters dropped first, then entries from the end (the oldest)."""
    from qworker.telemetry.propagation import MAX_TRACESTATE, bounded_tracestate

    short = "a=1,b=2"
    assert bounded_tracestate(short) == short
    entries = [f"k{i:03d}=" + "v" * 20 for i in range(30)]  # 26 characters each (the SDK keeps at most 32 entries)
    long_entry = "big=" + "x" * 200
    cut = bounded_tracestate(",".join([entries[0], long_entry, *entries[1:]]))
    kept = cut.split(",")
    assert len(cut) <= MAX_TRACESTATE and long_entry not in kept
    assert kept == entries[:len(kept)] and len(kept) == (MAX_TRACESTATE + 1) // 27  # the front kept, in order
    assert bounded_tracestate(",".join([long_entry] * 10)) == ""

    parent = extract([("traceparent", TP.encode()), ("tracestate", ",".join(entries).encode())])
    with tracing.tracer.start_as_current_span("child", context=parent):
        headers = dict(inject([]))
    assert len(headers["tracestate"]) <= MAX_TRACESTATE and headers["tracestate"].startswith(entries[0].encode())
