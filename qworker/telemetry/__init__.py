"""Observability for the worker: OpenTelemetry traces across Kafka, Prometheus metrics, probes, JSON logs.

- ``tracing``: tracer from the ``OTEL_*`` environment (no-op when unset)
- ``propagation``: W3C trace context in Kafka headers
- ``spans``/``genai``: the per-job span tree and its gen_ai attributes and events
- ``metrics``: ``qworker:*`` Prometheus metrics and the engine stats collector
- ``http``: ``/healthz``, ``/readyz``, ``/metrics``
- ``logging``: JSON or text log lines with trace ids, control characters escaped
"""

from qworker.telemetry.genai import GenerationTrace, operation_name
from qworker.telemetry.http import EngineLiveness, TelemetryServer
from qworker.telemetry.logging import JsonFormatter, TextFormatter, configure_json_logging, configure_logging, log_job_outcome
from qworker.telemetry.metrics import WorkerMetrics
from qworker.telemetry.propagation import extract, inject
from qworker.telemetry.spans import JobTrace, JobTracer
from qworker.telemetry.tracing import Tracing, configure_tracing

__all__ = [
    "EngineLiveness",
    "GenerationTrace",
    "JobTrace",
    "JobTracer",
    "JsonFormatter",
    "TelemetryServer",
    "TextFormatter",
    "Tracing",
    "WorkerMetrics",
    "configure_json_logging",
    "configure_logging",
    "configure_tracing",
    "extract",
    "inject",
    "log_job_outcome",
    "operation_name",
]
