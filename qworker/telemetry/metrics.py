"""Prometheus metrics, named as users already graph vLLM's (``vllm:`` -> ``qworker:``).

Why prometheus-client and not OpenTelemetry metrics with its Prometheus exporter:
- the names: OTel instrument names may not contain ``:``, so the OTel exporter could never emit
  ``qworker:time_to_first_token_seconds``; vLLM's dashboards and KEDA/HPA queries expect that
  shape, and vLLM itself uses prometheus-client;
- the model: Prometheus pulls, KEDA reads the same scrape; we need no push pipeline or
  temporality conversion, and an OTel exporter for Prometheus is one more dependency
  (``opentelemetry-exporter-prometheus`` is not installed) with its own HTTP server, while we
  want one port for probes and metrics;
- the cost: an increment is a lock and an add; nothing is aggregated in the background.
Traces stay on OpenTelemetry, which is what the issue asks of them.

Engine counters are exposed straight from the engine's cumulative ``stats()`` at scrape time
(``EngineStatsCollector``): no second copy to keep in step and no delta bookkeeping; a restart
resets them, which Prometheus' ``rate()`` handles.

Label cardinality is bounded by construction: ``model_name`` (one per worker), fixed enums
(``mode``, ``direction``, ``source``, ``outcome``), error ``code`` (sanitised and capped at
``MAX_CODES`` distinct values) and ``topic``/``partition`` of the partitions this pod owns. No
job id ever becomes a label.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

PREFIX = "qworker:"
OUTCOMES = ("completed", "error", "cancelled", "dlq", "abandoned")
MAX_CODES = 32
_CODE_RE = re.compile(r"^[a-z0-9_]{1,64}$")

# Seconds. A CPU pod is ~100x slower than a GPU one, so the buckets run long.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, 1200, 2400)
TOKEN_BUCKETS = tuple(float(2**i) for i in range(17))  # 1 .. 65536


class EngineStatsCollector(Collector):
    """Turns the engine's cumulative ``stats()`` dict into gauges and counters at each scrape.

    ``stats`` is called on the scraping thread; the engine's counters are plain ints read
    under the GIL, so a scrape sees each value whole (the set may be a step apart, which a
    scrape interval dwarfs). A failing ``stats`` (engine not started yet) yields nothing.
    """

    def __init__(self, stats: Callable[[], Mapping[str, Any]], model_name: str):
        self.stats = stats
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: families appear once the engine exists

    def collect(self) -> Iterator[Metric]:
        try:
            s = self.stats()
        except Exception:  # noqa: BLE001 - a scrape must not fail because the engine is not up yet
            log.debug("engine stats unavailable", exc_info=True)
            return
        m = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, values: Mapping[str, float] | float, label: str | None = None) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"] + ([label] if label else []))
            if isinstance(values, Mapping):
                for lv, v in values.items():
                    c.add_metric([*m, lv], v)
            else:
                c.add_metric(m, values)
            return c

        g = s.get
        cpu_total = g("cpu_swap_blocks_total", 0)
        yield gauge("num_requests_running", "Requests (choices) in the engine's running batch.", g("num_running", 0))
        yield gauge("num_requests_waiting", "Requests waiting in the engine to be scheduled (new or preempted by recompute).", g("num_waiting", 0))
        yield gauge("num_requests_swapped", "Requests preempted with their KV swapped to CPU.", g("num_swapped", 0))
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", g("kv_usage", 0.0))
        yield gauge("cpu_swap_usage_perc", "Fraction of CPU swap blocks in use (1 = full).", g("cpu_swap_blocks_used", 0) / cpu_total if cpu_total else 0.0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", g("prefix_cache_queries", 0))
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", g("prefix_cache_hits", 0))
        yield counter(
            "num_preemptions",
            "Sequences preempted for lack of KV blocks, by mode.",
            {"swap": g("preemptions_swap", 0), "recompute": g("preemptions_recompute", 0)},
            "mode",
        )
        yield counter("blocks_swapped", "KV blocks copied between device and CPU swap.", {"out": g("blocks_swapped_out", 0), "in": g("blocks_swapped_in", 0)}, "direction")
        yield counter("blocks_evicted", "Cached KV blocks reclaimed for new allocations (LRU).", g("blocks_evicted", 0))
        yield counter(
            "prompt_tokens",
            "Prompt tokens: computed by prefill (recomputation included) or cached.",
            {"computed": g("prompt_tokens_computed", 0), "cached": g("prompt_tokens_cached", 0)},
            "source",
        )
        yield counter("generation_tokens", "Tokens generated.", g("generation_tokens", 0))
        yield counter("engine_steps", "Engine steps run.", g("steps", 0))
        # structured output
        yield gauge("num_requests_compiling", "Requests waiting for their structured-output grammar to compile.", g("num_compiling", 0))
        yield counter("grammar_compilations", "Structured-output grammars compiled (cache misses).", g("grammar_compilations", 0))
        yield counter("grammar_cache_hits", "Structured-output grammar look-ups served from the cache (or a compile in flight).", g("grammar_cache_hits", 0))
        yield counter("grammar_compile_failures", "Structured-output specs the compiler refused.", g("grammar_compile_failures", 0))
        yield counter("grammar_compile_timeouts", "Structured-output compiles that ran past the timeout.", g("grammar_compile_timeouts", 0))
        yield counter("grammar_compile_seconds", "Seconds spent compiling structured-output grammars.", g("grammar_compile_seconds", 0.0))
        yield counter("structured_mask_seconds", "Seconds the engine step spent filling and applying structured-output token masks.", g("mask_seconds", 0.0))
        yield counter("structured_masked_rows", "Sampling rows masked by a structured-output grammar.", g("masked_rows", 0))
        # speculative decoding, vLLM's spec_decode names
        yield counter("spec_decode_num_drafts", "Draft proposals verified (one per speculating sequence per step).", g("spec_decode_num_drafts", 0))
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", g("spec_decode_num_draft_tokens", 0))
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", g("spec_decode_num_accepted_tokens", 0))
        yield counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0 = first).",
            {str(i): v for i, v in enumerate(g("spec_decode_num_accepted_tokens_per_pos", None) or [])},
            "position",
        )
        if "tp_size" in s:  # tensor parallelism: rank 0's share (each follower logs its own)
            yield gauge("tensor_parallel_size", "Ranks the model is sharded over (tensor parallelism).", g("tp_size", 1))
            yield counter("tp_step_seconds", "Seconds rank 0 spent in model steps (command broadcast, forward, all-reduces).", g("tp_step_seconds", 0.0))
            yield counter("tp_allreduce_seconds", "Seconds rank 0 spent in all-reduces (on CUDA: enqueueing them).", g("tp_allreduce_seconds", 0.0))
            yield counter("tp_allreduce_calls", "All-reduces rank 0 ran (two per layer per step).", g("tp_allreduce_calls", 0))


class WorkerSnapshot(Collector):
    """Exposes the last ``update``: the worker's state belongs to the event loop, the scrape
    runs on a thread, so the loop hands over plain dicts (swapped whole, never mutated)."""

    def __init__(self) -> None:
        self._counters: dict[str, float] = {}
        self._gauges: dict[str, float] = {}

    def update(self, counters: Mapping[str, float], gauges: Mapping[str, float]) -> None:
        self._counters, self._gauges = dict(counters), dict(gauges)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for name, value in self._counters.items():
            yield CounterMetricFamily(PREFIX + name, f"Worker counter: {name}.", value=value)
        for name, value in self._gauges.items():
            yield GaugeMetricFamily(PREFIX + name, f"Worker gauge: {name}.", value=value)


class RequestTimer:
    """Inter-token latency of one request, from the arrival times of its streamed deltas.

    The engine emits one delta per request per step, holding that step's token for each choice,
    so the gap between deltas is the gap between tokens as the worker saw them.
    """

    __slots__ = ("_hist", "_last")

    def __init__(self, hist: Any):
        self._hist = hist
        self._last: float | None = None

    def on_output(self, num_new_tokens: int, now: float | None = None) -> None:
        if not num_new_tokens:
            return
        t = time.monotonic() if now is None else now
        if self._last is not None:
            self._hist.observe(t - self._last)
        self._last = t


class WorkerMetrics:
    """Every qworker metric, in its own registry (so two workers in one test process do not
    collide). ``stats`` is the engine's ``stats`` callable, attachable later with
    ``attach_engine``."""

    def __init__(self, model_name: str, *, stats: Callable[[], Mapping[str, Any]] | None = None, registry: CollectorRegistry | None = None):
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        r, L = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, L, buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Job received -> first token.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens of a request.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Job received -> finished.", E2E_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Job received -> first scheduled (admission wait + engine queue).", E2E_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.generation_tokens = hist("request_generation_tokens", "Generated tokens per request (all choices).", TOKEN_BUCKETS)
        self._jobs = Counter(PREFIX + "jobs", "Jobs finished, by outcome and error code.", ["model_name", "outcome", "code"], registry=r)
        self._lag = Gauge(PREFIX + "consumer_lag", "High watermark minus committed offset, per owned partition.", ["topic", "partition"], registry=r)
        self._codes: set[str] = set()
        self._lag_keys: set[tuple[str, str]] = set()
        self._engine: EngineStatsCollector | None = None
        if stats is not None:
            self.attach_engine(stats)
        self._worker = WorkerSnapshot()
        r.register(self._worker)
        from qworker.telemetry.lora_metrics import LoRAMetrics

        self.lora = LoRAMetrics(model_name, r)  # exposes nothing until the worker serves LoRA

    def attach_engine(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        if self._engine is not None:
            self.registry.unregister(self._engine)
        self._engine = EngineStatsCollector(stats, self.model_name)
        self.registry.register(self._engine)

    # -- per request ----------------------------------------------------------------------------
    def request_timer(self) -> RequestTimer:
        return RequestTimer(self.itl)

    def observe_request(
        self,
        metrics: Any,
        num_output_tokens: int,
        *,
        num_prompt_tokens: int | None = None,
        start_time: float | None = None,
    ) -> None:
        """Latency histograms of a finished request from its ``RequestMetrics`` (time.time()
        stamps). ``start_time`` is when the worker received the job (default: the engine's
        arrival time); times before it (clock skew) count as zero."""
        ref = metrics.arrival_time if start_time is None else start_time
        if metrics.first_token_time is not None:
            self.ttft.observe(max(0.0, metrics.first_token_time - ref))
        if metrics.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, metrics.first_scheduled_time - ref))
        end = metrics.finished_time if metrics.finished_time is not None else time.time()
        self.e2e.observe(max(0.0, end - ref))
        self.generation_tokens.observe(num_output_tokens)
        if num_prompt_tokens is not None:
            self.prompt_tokens.observe(num_prompt_tokens)

    # -- jobs -----------------------------------------------------------------------------------
    def job_outcome(self, outcome: str, code: str | None = None) -> None:
        """Counts a finished job. ``outcome`` is one of ``OUTCOMES``; ``code`` the error code
        (kept only while fewer than ``MAX_CODES`` distinct codes were seen, else ``other``)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown job outcome {outcome!r}")
        self._jobs.labels(self.model_name, outcome, self._code_label(code)).inc()

    def _code_label(self, code: str | None) -> str:
        if not code:
            return ""
        if code in self._codes:
            return code
        if not _CODE_RE.match(code) or len(self._codes) >= MAX_CODES:
            return "other"
        self._codes.add(code)
        return code

    def update_worker(self, counters: Mapping[str, float], gauges: Mapping[str, float]) -> None:
        """Worker-side counters (``qworker:<name>_total``) and gauges (``qworker:<name>``),
        snapshotted by their owner, the event loop; scrapes read the last snapshot."""
        self._worker.update(counters, gauges)

    # -- consumer lag ---------------------------------------------------------------------------
    def set_consumer_lag(self, topic: str, partition: int, lag: int) -> None:
        key = (topic, str(partition))
        self._lag_keys.add(key)
        self._lag.labels(*key).set(max(0, lag))

    def retain_consumer_lag(self, owned: set[tuple[str, int]]) -> None:
        """Drops the lag series of partitions this pod no longer owns (after a rebalance), so
        a partition's lag is reported by its owner only."""
        keep = {(t, str(p)) for t, p in owned}
        for key in self._lag_keys - keep:
            self._lag.remove(*key)
        self._lag_keys &= keep

    # -- exposition -----------------------------------------------------------------------------
    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition body and its content type, negotiated from an ``Accept`` header."""
        try:
            encoder, content_type = choose_encoder(accept or "")
        except Exception:  # noqa: BLE001 - a malformed header (version=abc): the default format, as for none
            encoder, content_type = choose_encoder("")
        return encoder(self.registry), content_type
