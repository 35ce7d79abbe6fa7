"""Fixtures: a tracer that records into memory, fake engine outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from qworker.telemetry.tracing import Tracing, from_provider


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exporter: InMemorySpanExporter) -> Tracing:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    t = from_provider(provider)
    yield t
    t.shutdown()


def fake_metrics(arrival: float = 100.0, **kw) -> SimpleNamespace:
    """Stands in for the engine's ``RequestMetrics`` (same field names)."""
    base = dict(arrival_time=arrival, first_scheduled_time=None, first_token_time=None, finished_time=None, num_preemptions=0, events=[])
    base.update(kw)
    return SimpleNamespace(**base)


def fake_output(token_ids: list[int], metrics: SimpleNamespace, finish_reason: str | None = None) -> SimpleNamespace:
    """Stands in for a streamed ``RequestOutput`` delta with one choice."""
    choice = SimpleNamespace(index=0, text="x" * len(token_ids), token_ids=token_ids, finish_reason=finish_reason)
    return SimpleNamespace(outputs=[choice], metrics=metrics, finished=finish_reason is not None)


# ---------------------------------------------------------------------------- broker and worker
# The broker, per-test topics and the real engine are the worker tests' fixtures, reused as is.
from tests.worker.conftest import Results, broker, real_engine, topics  # noqa: E402, F401


class RawResults(Results):
    """``Results`` that also keeps every raw record (for headers), by (topic, job id)."""

    def __init__(self, s) -> None:
        super().__init__(s)
        self.raw: dict[tuple[str, str], list] = {}

    async def start(self) -> RawResults:
        records = self.reader.records

        async def tapped(*args, **kwargs):
            async for rec in records(*args, **kwargs):
                key = rec.key.decode("utf-8", "replace") if rec.key else ""
                self.raw.setdefault((rec.topic, key), []).append(rec)
                yield rec

        self.reader.records = tapped
        await super().start()
        return self


@pytest.fixture
async def raw_results(topics) -> RawResults:
    r = await RawResults(topics).start()
    yield r
    await r.stop()
