"""LoRA metrics: vLLM's ``vllm:lora_requests_info`` (as ``qworker:lora_requests_info``) and
per-adapter counts.

- ``qworker:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}``: vLLM's
  shape: one gauge whose labels carry the comma-separated names of the adapters with running
  and with waiting requests and the slot count; its value is the Unix time of the snapshot.
  Only the current combination is exposed (a collector, not a labelled Gauge), so old label
  sets do not pile up.
- ``qworker:lora_requests_running`` / ``_waiting{model_name, lora_name}``: the same per adapter,
  as numbers. Running: in the engine's running batch; waiting: in the engine's queue or the
  worker's (the worker's ``Gauges`` merges the engine's ``lora_stats()`` with its own queue).
- ``qworker:lora_requests_total{model_name, lora_name, outcome}``: jobs finished per adapter.
- ``qworker:lora_adapters{model_name, state}``: adapters served / refused now;
  ``qworker:lora_adapter_refusals_total{model_name, lora_name}``: validation failures (start and
  reloads); ``qworker:lora_modules_file_errors_total``: versions of the modules file not used.

Cardinality: ``lora_name`` is only ever a name from the operator's ``QWORKER_LORA_MODULES``
(a job naming an unknown adapter is counted by ``qworker:jobs_total{code="model_not_found"}``),
so it is bounded by the configuration.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "qworker:"


@dataclass(frozen=True, slots=True)
class LoRASnapshot:
    """The adapter state as the worker's loop saw it (handed over whole)."""

    max_lora: int
    served: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    running: Mapping[str, int] = field(default_factory=dict)
    waiting: Mapping[str, int] = field(default_factory=dict)
    refusals: Mapping[str, int] = field(default_factory=dict)
    file_errors: int = 0
    at: float = 0.0


class LoRAMetrics(Collector):
    def __init__(self, model_name: str, registry: CollectorRegistry):
        self.model_name = model_name
        self._snap: LoRASnapshot | None = None  # None: LoRA off, nothing exposed
        self._requests = Counter(PREFIX + "lora_requests", "Jobs finished under a LoRA adapter, by outcome.", ["model_name", "lora_name", "outcome"], registry=registry)
        registry.register(self)

    def update(self, snap: LoRASnapshot) -> None:
        self._snap = snap

    def job_outcome(self, lora_name: str, outcome: str) -> None:
        self._requests.labels(self.model_name, lora_name, outcome).inc()

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator:
        s = self._snap
        if s is None:
            return
        m = self.model_name
        info = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running stats on LoRA requests (vLLM's vllm:lora_requests_info); the value is the snapshot's Unix time.",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        running = sorted(n for n, c in s.running.items() if c)
        waiting = sorted(n for n, c in s.waiting.items() if c)
        info.add_metric([",".join(running), ",".join(waiting), str(s.max_lora)], s.at or time.time())
        yield info
        for name, doc, values in (("lora_requests_running", "Requests in the engine's running batch, per LoRA adapter.", s.running),
                                  ("lora_requests_waiting", "Requests waiting (engine queue and worker queue), per LoRA adapter.", s.waiting)):
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name", "lora_name"])
            for lora in s.served:
                g.add_metric([m, lora], values.get(lora, 0))
            yield g
        g = GaugeMetricFamily(PREFIX + "lora_adapters", "LoRA adapters configured, by state (served, refused).", labels=["model_name", "state"])
        g.add_metric([m, "served"], len(s.served))
        g.add_metric([m, "refused"], len(s.refused))
        yield g
        c = CounterMetricFamily(PREFIX + "lora_adapter_refusals", "LoRA adapters refused by validation (at start or on reload).", labels=["model_name", "lora_name"])
        for lora, n in sorted(s.refusals.items()):
            c.add_metric([m, lora], n)
        yield c
        yield CounterMetricFamily(PREFIX + "lora_modules_file_errors", "Versions of the LoRA modules file that could not be read or parsed (the last good set stays).",
                                  value=s.file_errors)
