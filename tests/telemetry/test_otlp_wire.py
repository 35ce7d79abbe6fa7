"""The real OTLP/HTTP exporter against a receiver on loopback that decodes the protobuf payload:
the wire format is proven, not assumed."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan

from qworker.telemetry import genai
from qworker.telemetry.spans import JobTracer
from qworker.telemetry.tracing import configure_tracing, exporter_names

from .conftest import fake_metrics, fake_output

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Receiver:
    """A minimal OTLP/HTTP traces endpoint (POST /v1/traces, binary protobuf) in a thread."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], ExportTraceServiceRequest]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                outer.requests.append((self.path, {k.lower(): v for k, v in self.headers.items()}, req))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = [x.string_value for x in v.array_value.values] if kind == "array_value" else getattr(v, kind)
    return out


def test_env_decides_whether_tracing_is_on():
    assert exporter_names({}) == []
    assert exporter_names({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ["otlp"]
    assert exporter_names({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}) == ["otlp"]
    assert exporter_names({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}) == []
    assert exporter_names({"OTEL_TRACES_EXPORTER": "otlp,console"}) == ["otlp", "console"]
    assert exporter_names({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}) == []
    assert not configure_tracing({}, install_global=False).enabled
    grpc = configure_tracing({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, install_global=False)
    assert grpc.enabled  # the gRPC exporter ships with qworker
    with pytest.raises(RuntimeError, match="protocol"):
        configure_tracing({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "carrier-pigeon"}, install_global=False)
    with pytest.raises(RuntimeError, match="zipkin"):
        configure_tracing({"OTEL_TRACES_EXPORTER": "zipkin"}, install_global=False)


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_otlp_http_export_decodes(monkeypatch, compression):
    with Receiver() as rx:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{rx.port}/v1/traces")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", compression)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=qa")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "qworker-wire-test")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        for var in ("OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
            monkeypatch.delenv(var, raising=False)
        tracing = configure_tracing(install_global=False)
        assert tracing.enabled
        jt = JobTracer(tracing, group_id="g1", model="smollm2-135m").start_job("jobs", 1, 7, b"job-7", [("traceparent", TP.encode())])
        jt.admission().end()
        gen = jt.generation("text_completion", {"max_tokens": 4, "temperature": 0.5, "top_p": 1.0, "seed": 3}, stream=False)
        m = fake_metrics(10.0, first_scheduled_time=10.1, first_token_time=10.2, finished_time=10.4)
        gen.on_output(fake_output([1, 2], m, "length"))
        gen.finish(None, finish_reasons=["length"], input_tokens=5, output_tokens=2, cached_tokens=0)
        with jt.publish("completions"):
            pass
        jt.end("completed")
        tracing.shutdown()  # flushes the batch processor: the export happens before this returns

    assert rx.requests, "the exporter sent nothing"
    path, headers, _ = rx.requests[0]
    assert path == "/v1/traces" and headers.get("content-type") == "application/x-protobuf"
    assert headers.get("x-tenant") == "qa"
    assert headers.get("content-encoding") == ("gzip" if compression == "gzip" else None)
    spans, services = {}, set()
    for _, _, req in rx.requests:
        for rs in req.resource_spans:
            services |= {kv.value.string_value for kv in rs.resource.attributes if kv.key == "service.name"}
            for ss in rs.scope_spans:
                assert ss.scope.name == "qworker"
                for s in ss.spans:
                    spans[s.name] = s
    assert services == {"qworker-wire-test"}
    assert set(spans) == {"process jobs", "admission wait", "generate", "publish"}
    p = spans["process jobs"]
    assert p.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c" and p.parent_span_id.hex() == "b7ad6b7169203331"
    assert p.kind == PbSpan.SPAN_KIND_CONSUMER
    pa = _attrs(p)
    assert pa["messaging.system"] == "kafka" and pa["messaging.destination.name"] == "jobs"
    assert pa["messaging.kafka.offset"] == 7 and pa["messaging.destination.partition.id"] == "1"
    assert pa["messaging.consumer.group.name"] == "g1" and pa["messaging.kafka.message.key"] == "job-7"
    for name in ("admission wait", "generate", "publish"):
        assert spans[name].parent_span_id == p.span_id and spans[name].trace_id == p.trace_id
    g = _attrs(spans["generate"])
    assert g["gen_ai.operation.name"] == "text_completion" and g["gen_ai.request.model"] == "smollm2-135m"
    assert g["gen_ai.request.max_tokens"] == 4 and g["gen_ai.request.temperature"] == 0.5 and g["gen_ai.request.seed"] == 3
    assert g["gen_ai.response.finish_reasons"] == ["length"]
    assert g["gen_ai.usage.input_tokens"] == 5 and g["gen_ai.usage.output_tokens"] == 2
    assert [e.name for e in spans["generate"].events] == [genai.EV_FIRST_TOKEN]
    assert spans["publish"].kind == PbSpan.SPAN_KIND_PRODUCER
