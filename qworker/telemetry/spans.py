"""The span tree of one job.

```
process <jobs topic>          CONSUMER  parent: the producer's traceparent, if any
├── admission wait            INTERNAL  received -> admitted to the engine
├── generate                  INTERNAL  gen_ai.* attributes; events first_token, preemption, swap_out/in, abort
└── publish                   PRODUCER  the completion/error (result messages carry its traceparent)
```

The ``process`` span is the job's: it starts when the record is taken from the consumer and ends
with the job's outcome (``qworker.job.outcome``). Children are started with an explicit parent
context, so they do not depend on which asyncio task (contextvars) runs them.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from qworker.telemetry.genai import GenerationTrace, request_attributes
from qworker.telemetry.propagation import extract, inject
from qworker.telemetry.tracing import Tracing

ADMISSION = "admission wait"
GENERATE = "generate"
PUBLISH = "publish"


# a record key is copied into its span for finding the record, not as data: keys of a megabyte held
# that much per queued span (2,048 of them) while a collector stalled
MAX_KEY_CHARS = 256


def _key_text(key: bytes | str | None) -> str | None:
    if key is None:
        return None
    if isinstance(key, bytes):
        # strict, but a longer key's first bytes may end inside a character: that one is left out
        whole = len(key) <= 4 * MAX_KEY_CHARS
        try:
            key = codecs.getincrementaldecoder("utf-8")().decode(key[:4 * MAX_KEY_CHARS], final=whole)
        except UnicodeDecodeError:
            return None  # the convention asks for the key only when it is readable text
    return key if len(key) <= MAX_KEY_CHARS else key[:MAX_KEY_CHARS - 1] + "…"


class JobTracer:
    """Starts job traces for one worker (consumer group, model)."""

    def __init__(self, tracing: Tracing, *, group_id: str, model: str):
        self.tracer = tracing.tracer
        self.enabled = tracing.enabled
        self.group_id = group_id
        self.model = model

    def start_job(
        self,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | str | None,
        headers: Iterable[tuple[str, bytes | None]] | None,
        *,
        start_time: float | None = None,
    ) -> JobTrace:
        """The ``process`` span for a record; ``start_time`` (time.time()) back-dates it to when
        the record was fetched."""
        parent = extract(headers)
        attrs: dict[str, Any] | None = None
        if self.enabled:
            attrs = {
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": topic,
                "messaging.destination.partition.id": str(partition),
                "messaging.kafka.offset": offset,
                "messaging.consumer.group.name": self.group_id,
            }
            text = _key_text(key)
            if text is not None:
                attrs["messaging.kafka.message.key"] = text
        span = self.tracer.start_span(
            f"process {topic}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attrs,
            start_time=None if start_time is None else int(start_time * 1e9),
        )
        return JobTrace(self, span)


class JobTrace:
    """One job's ``process`` span and helpers for its children."""

    __slots__ = ("tracer", "span", "context", "recording", "_ended")

    def __init__(self, owner: JobTracer, span: Span):
        self.tracer = owner
        self.span = span
        self.context: Context = trace.set_span_in_context(span)
        self.recording = span.is_recording()
        self._ended = False

    def set_attributes(self, attrs: dict[str, Any]) -> None:
        if self.recording:
            self.span.set_attributes(attrs)

    @contextmanager
    def activate(self) -> Iterator[Span]:
        """Makes the job span current (log lines then carry its trace and span ids)."""
        with trace.use_span(self.span, end_on_exit=False):
            yield self.span

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL, attributes: dict[str, Any] | None = None, start_time: float | None = None) -> Span:
        """A started child span; the caller ends it."""
        return self.tracer.tracer.start_span(
            name,
            context=self.context,
            kind=kind,
            attributes=attributes if self.recording else None,
            start_time=None if start_time is None else int(start_time * 1e9),
        )

    def admission(self, start_time: float | None = None) -> Span:
        """The ``admission wait`` span: end it when the engine takes the job."""
        return self.child(ADMISSION, start_time=start_time)

    def generation(self, operation: str, sampling: Any, *, stream: bool | None = None, model: str | None = None) -> GenerationTrace:
        attrs = request_attributes(operation, model or self.tracer.model, sampling, stream=stream) if self.recording else None
        return GenerationTrace(self.child(GENERATE, attributes=attrs))

    @contextmanager
    def publish(self, topic: str, headers: list[tuple[str, bytes]] | None = None) -> Iterator[list[tuple[str, bytes]]]:
        """The ``publish`` span around producing a result; yields the record headers to send,
        with this span's ``traceparent`` (the producer's context passes through when tracing is
        off)."""
        attrs = {"messaging.system": "kafka", "messaging.operation.type": "send", "messaging.destination.name": topic} if self.recording else None
        span = self.child(PUBLISH, SpanKind.PRODUCER, attrs)
        try:
            with trace.use_span(span, end_on_exit=False, record_exception=True, set_status_on_exception=True):
                yield inject(headers, trace.set_span_in_context(span))
        finally:
            span.end()

    def headers(self, headers: list[tuple[str, bytes]] | None = None) -> list[tuple[str, bytes]]:
        """Record headers carrying the job span's ``traceparent`` (for stream events)."""
        return inject(headers, self.context)

    def end(self, outcome: str, code: str | None = None, error: BaseException | str | None = None) -> None:
        """Ends the job span once with its outcome (completed, cancelled, error, dlq, abandoned)."""
        if self._ended:
            return
        self._ended = True
        if self.recording:
            attrs: dict[str, Any] = {"qworker.job.outcome": outcome}
            if code:
                attrs["error.type"] = code
            self.span.set_attributes(attrs)
            if error is not None or outcome in ("error", "dlq"):
                if isinstance(error, BaseException):
                    self.span.record_exception(error)
                self.span.set_status(Status(StatusCode.ERROR, str(error or code or outcome)))
        self.span.end()
