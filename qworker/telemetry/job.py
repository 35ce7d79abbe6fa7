"""The worker's one handle on telemetry: per-job spans, metrics and the outcome log line.

The worker calls, for each job record:
``job = telemetry.job(...)`` when fetched -> ``job.queued()`` / ``job.admitted()`` around the
admission wait -> ``job.generating(...)``, ``job.on_output(out)`` per delta, ``job.generated(...)``
-> ``with job.publish(topic) as headers`` around the result -> ``job.outcome(...)`` exactly once.
Each step tolerates the ones before it being skipped (a job rejected at once is never queued or
generated), so error paths need no special cases.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry.trace import INVALID_SPAN, Span

from qworker.telemetry.genai import GenerationTrace
from qworker.telemetry.logging import log_job_outcome
from qworker.telemetry.metrics import RequestTimer, WorkerMetrics
from qworker.telemetry.spans import JobTrace, JobTracer
from qworker.telemetry.tracing import Tracing, disabled

log = logging.getLogger("qworker.jobs")

Headers = Iterable[tuple[str, bytes | None]] | None
_ENDED = INVALID_SPAN  # an admission span that was already ended (ending it is a no-op)


class Telemetry:
    """Built once per worker."""

    def __init__(self, tracing: Tracing | None, metrics: WorkerMetrics, *, group_id: str, model: str):
        self.tracing = tracing or disabled()
        self.metrics = metrics
        self.tracer = JobTracer(self.tracing, group_id=group_id, model=model)

    async def stop(self, shutdown_tracing: bool = True) -> None:
        """Flushes spans; ``shutdown_tracing=False`` leaves a tracer the caller owns (and may
        share) running."""
        # the exporter may block on the network for its timeout: keep it off the event loop
        await asyncio.to_thread(self.tracing.shutdown if shutdown_tracing else self.tracing.flush)

    def job(self, job_id: str, topic: str, partition: int, offset: int, key: bytes | str | None, headers: Headers, received_at: float | None = None) -> JobTelemetry:
        return JobTelemetry(self, job_id, self.tracer.start_job(topic, partition, offset, key, headers, start_time=received_at), received_at)

    def dead_letter(self, topic: str, partition: int, offset: int, key: bytes | str | None, headers: Headers, code: str) -> None:
        """A record that cannot be answered went to the DLQ: its own short trace and one count."""
        j = self.job("", topic, partition, offset, key, headers)
        j.outcome("dlq", code, partition=partition, offset=offset)


class JobTelemetry:
    __slots__ = ("owner", "job_id", "trace", "received_at", "lora", "_admission", "_gen", "_timer", "_done")

    def __init__(self, owner: Telemetry, job_id: str, trace: JobTrace, received_at: float | None):
        self.owner = owner
        self.job_id = job_id
        self.trace = trace
        self.received_at = received_at
        self.lora: str | None = None  # the LoRA adapter the job runs under
        self._admission: Span | None = None
        self._gen: GenerationTrace | None = None
        self._timer: RequestTimer | None = None
        self._done = False

    def set_lora(self, name: str) -> None:
        """The job runs under this adapter: ``qworker.lora.name`` on its spans, its outcome
        counted per adapter, and ``gen_ai.request.model`` names it (as a vLLM server's would)."""
        self.lora = name
        self.trace.set_attributes({"qworker.lora.name": name})

    # -- admission -----------------------------------------------------------------------------
    def queued(self) -> None:
        if self._admission is None:  # once: a requeued job keeps its first admission span
            self._admission = self.trace.admission(self.received_at)

    def admitted(self) -> None:
        if self._admission is not None:
            self._admission.end()
            self._admission = _ENDED

    # -- generation ----------------------------------------------------------------------------
    def generating(self, operation: str, sampling: Any, *, stream: bool | None = None) -> None:
        """The run starts on the engine: ``operation`` is ``chat`` or ``text_completion``
        (``genai.operation_name`` derives it from an engine prompt)."""
        self.admitted()
        self._gen = self.trace.generation(operation, sampling, stream=stream, model=self.lora)
        if self.lora is not None:
            self._gen.set_attributes({"qworker.lora.name": self.lora})
        self._timer = self.owner.metrics.request_timer()

    def on_output(self, out: Any) -> None:
        """Each streamed ``RequestOutput`` delta."""
        if self._timer is not None:
            self._timer.on_output(sum(len(c.token_ids) for c in out.outputs))
        if self._gen is not None:
            self._gen.on_output(out)

    def generated(self, last: Any | None, *, finish_reasons: Iterable[str], input_tokens: int, output_tokens: int, cached_tokens: int = 0,
                  aborted: str | None = None, error: str | None = None) -> None:
        """The run is over (``last``: the final delta, None if none came). Ends the generate
        span (as an error with ``error``, the engine's error code) and observes the latency histograms."""
        m = getattr(last, "metrics", None)
        if m is not None:
            self.owner.metrics.observe_request(m, output_tokens, num_prompt_tokens=input_tokens, start_time=self.received_at)
        if self._gen is not None:
            if aborted:
                self._gen.abort(aborted)
            if error:
                self._gen.error(error)
            self._gen.finish(
                last,
                finish_reasons=finish_reasons,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                cached_tokens=cached_tokens,
                response_model=self.lora or self.owner.tracer.model,
                response_id=self.job_id or None,
            )

    def failed(self, error: BaseException | str) -> None:
        """The run raised or was abandoned: the generate span ends as an error."""
        if self._gen is not None:
            self._gen.fail(error)

    # -- results -------------------------------------------------------------------------------
    @contextmanager
    def publish(self, topic: str, headers: list[tuple[str, bytes]] | None = None) -> Iterator[list[tuple[str, bytes]]]:
        """Wraps producing the result; yields headers carrying the ``traceparent``."""
        with self.trace.publish(topic, headers) as h:
            yield h

    def stream_headers(self) -> list[tuple[str, bytes]]:
        """Headers for streamed delta events (the job span's context)."""
        return self.trace.headers()

    def log_fields(self) -> dict[str, str]:
        """``extra=`` for a log line about this job: its id, and its trace id when it has one
        (the producer's, passed through, when tracing is off)."""
        out = {"job_id": self.job_id}
        ctx = self.trace.span.get_span_context()
        if ctx.is_valid:
            out["trace_id"] = format(ctx.trace_id, "032x")
        return out

    def outcome(self, outcome: str, code: str | None = None, **fields: Any) -> None:
        """Exactly once per job: the jobs counter, the process span's end, the log line."""
        if self._done:
            return
        self._done = True
        self.admitted()
        if outcome in ("error", "abandoned"):
            self.failed(code or outcome)  # no-op when the generate span already ended
        self.owner.metrics.job_outcome(outcome, code)
        if self.lora is not None:
            self.owner.metrics.lora.job_outcome(self.lora, outcome)
        if self.received_at is not None:
            fields.setdefault("seconds", round(time.time() - self.received_at, 4))
        with self.trace.activate():
            log_job_outcome(log, self.job_id, outcome, code=code, **fields)
        self.trace.end(outcome, code)


class NullJobTelemetry:
    """The stand-in for a job built without telemetry (tests, a job state made by hand): every
    call is a no-op and ``publish`` passes the headers through."""

    __slots__ = ()

    def __getattr__(self, name: str) -> Any:
        return _noop

    @contextmanager
    def publish(self, topic: str, headers: list[tuple[str, bytes]] | None = None) -> Iterator[list[tuple[str, bytes]]]:
        yield [] if headers is None else headers

    def stream_headers(self) -> list[tuple[str, bytes]]:
        return []

    def log_fields(self) -> dict[str, str]:
        return {}


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


NULL_JOB = NullJobTelemetry()
