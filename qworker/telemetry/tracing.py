"""Tracer setup from the standard ``OTEL_*`` environment variables.

Tracing is *off* unless an operator asks for it: ``OTEL_TRACES_EXPORTER`` names an exporter, or an
OTLP endpoint (``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set.
(The SDK's own default exporter is ``otlp``; we deliberately do not export to localhost:4318 by
default, since a pod with no collector would then log export failures forever.)

When off, the tracer is the API's no-op tracer: ``start_span`` hands back the parent's
``NonRecordingSpan`` (no allocation, no ids generated, no processor), so a producer's
``traceparent`` still passes through to our result messages untouched. Callers check
``span.is_recording()`` before building attribute dicts, which keeps the off path near free.

Everything else is the SDK's business and read from the environment by it: the resource
(``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``), the sampler (``OTEL_TRACES_SAMPLER``,
``OTEL_TRACES_SAMPLER_ARG``), the batch processor (``OTEL_BSP_*``) and the exporter's endpoint,
headers, timeout and compression (``OTEL_EXPORTER_OTLP_*``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

log = logging.getLogger(__name__)

INSTRUMENTATION_NAME = "qworker"
CLOSE_TIMEOUT_S = 5.0  # the longest a flush or the shutdown waits for the collector
DEFAULT_SERVICE_NAME = "qworker"


@dataclass(slots=True)
class Tracing:
    """A configured tracer and the provider behind it (``None`` when tracing is off)."""

    tracer: trace.Tracer
    provider: TracerProvider | None = None

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def flush(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Exports queued spans now, waiting at most ``timeout_s``."""
        if self.provider is not None:
            _within(self.provider.force_flush, timeout_s, "flush")

    def shutdown(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Flushes queued spans and stops the exporters, waiting at most ``timeout_s``; for the
        provider's owner only."""
        if self.provider is not None:
            _within(self.provider.shutdown, timeout_s, "shutdown")


def _within(call, timeout_s: float, what: str) -> None:
    """``call()`` on a daemon thread, waited for at most ``timeout_s``: the SDK's flush waits on
    a collector without limit and its shutdown for every queued batch at the exporter's timeout
    each (a collector that accepted and never answered held a worker's stop for 30 s, past its
    grace period). Spans not exported by then are dropped with the process."""
    t = threading.Thread(target=call, name=f"otel-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        log.warning("tracing %s: the collector did not take the queued spans within %.0f s; they are dropped", what, timeout_s)


def disabled() -> Tracing:
    return Tracing(trace.NoOpTracer())


def from_provider(provider: TracerProvider) -> Tracing:
    """Wraps a provider built by the caller (tests: one with an in-memory exporter)."""
    return Tracing(provider.get_tracer(INSTRUMENTATION_NAME), provider)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() == "true"


def exporter_names(env: Mapping[str, str]) -> list[str]:
    """The exporters the environment asks for; empty means tracing stays off."""
    if _truthy(env.get("OTEL_SDK_DISABLED")):
        return []
    raw = env.get("OTEL_TRACES_EXPORTER")
    if raw is None or not raw.strip():
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return ["otlp"] if endpoint else []
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    return [] if "none" in names else names


class TracingConfigError(RuntimeError):
    """An ``OTEL_*`` setting the worker cannot honour; the message names it, on one line."""


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf").strip()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError as e:  # a dependency, but a slimmed image may lack it: fail at start
            raise TracingConfigError("OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc installed") from e
        return GrpcExporter()
    if protocol != "http/protobuf":
        raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL (or OTEL_EXPORTER_OTLP_TRACES_PROTOCOL): unsupported OTLP protocol {protocol!r} (use http/protobuf or grpc)")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _exporter(name: str, env: Mapping[str, str]) -> SpanExporter:
    if name == "otlp":
        return _otlp_exporter(env)
    if name == "console":
        return ConsoleSpanExporter()
    raise TracingConfigError(f"unsupported OTEL_TRACES_EXPORTER {name!r} (use otlp, console or none)")


def configure_tracing(env: Mapping[str, str] | None = None, *, install_global: bool = True) -> Tracing:
    """Builds the tracer the environment asks for; the no-op tracer when it asks for none.

    ``install_global`` makes it the process-wide provider too (so third-party instrumentation
    joins the same traces); the API allows that once per process, so tests pass False.
    Raises ``TracingConfigError`` (a ``RuntimeError``) for a misconfiguration, so a pod fails
    at start rather than silently dropping every span.
    """
    env = os.environ if env is None else env
    names = exporter_names(env)
    if not names:
        return disabled()
    attrs = {} if env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "") else {SERVICE_NAME: DEFAULT_SERVICE_NAME}
    # shutdown_on_exit off: the worker shuts the provider down itself, within a time limit; the
    # SDK's exit hook would wait for the collector again, without one
    provider = TracerProvider(resource=Resource.create(attrs), shutdown_on_exit=False)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, env)))
    if install_global:
        trace.set_tracer_provider(provider)
    log.info("tracing on: exporters=%s", ",".join(names))
    return from_provider(provider)
