"""Gauges: the loop-owned state handed to the metrics (scrapes run on another thread).

Owns nothing: it reads the consumer, the offset tracker, the registry, the LoRA adapter table and
the engine's capacity on the worker's loop and writes them into ``WorkerMetrics``, which a scrape reads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from qworker.telemetry.lora_metrics import LoRASnapshot

if TYPE_CHECKING:
    from qworker.worker.app import Worker

log = logging.getLogger(__name__)


class Gauges:
    def __init__(self, worker: Worker):
        self.w = worker

    async def observe_loop(self, interval_s: float) -> None:
        """Observe every ``interval_s``, on its own: a round of another loop that blocks (a
        commit waiting for a broker that went away) must not freeze what ``/metrics`` shows."""
        while not self.w.closed:
            await asyncio.sleep(interval_s)
            try:
                self.observe()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("observing the gauges failed")

    def observe(self) -> None:
        """Consumer lag per owned partition (high watermark from the last fetch, which Tansu
        reports right, minus the offset we would commit) and the worker's own counters and gauges."""
        w = self.w
        if w.metrics is None:
            return
        owned: set[tuple[str, int]] = set()
        if w.consumer is not None:
            for tp in w.consumer.assignment():
                owned.add((tp.topic, tp.partition))
                hw, c = w.consumer.highwater(tp), w.tracker.committable(tp)
                if hw is not None:
                    # no record seen since it was assigned: its fetches found none past the
                    # position, so it is at its end (it had no series before: helper-72)
                    w.metrics.set_consumer_lag(tp.topic, tp.partition, 0 if c is None else hw - c)
        w.metrics.retain_consumer_lag(owned)
        # job outcomes are counted by qworker:jobs_total{outcome}; these are the rest
        counters = {k: v for k, v in asdict(w.stats).items() if k not in ("completed", "cancelled", "errors", "dlq", "abandoned")}
        w.metrics.update_worker(counters, self.gauges())
        if w.settings.lora_enabled:
            w.metrics.lora.update(self.lora())

    def lora(self) -> LoRASnapshot:
        """Requests per adapter. With the engine's ``lora_stats()``: running = in its running
        batch, waiting = in its queue plus queued in the worker (vLLM's meaning, with the
        worker's own queue counted as waiting too). Without it: running = handed to the engine."""
        w = self.w
        cfg = getattr(getattr(w.engine, "engine", None), "config", None)
        max_lora = int(getattr(cfg, "max_loras", 0) or 0)
        stats = getattr(w.engine, "lora_stats", None)
        engine_view = stats() if callable(stats) else None
        running: dict[str, int] = dict(engine_view.get("running", {})) if engine_view else {}
        waiting: dict[str, int] = dict(engine_view.get("waiting", {})) if engine_view else {}
        if engine_view:
            max_lora = int(engine_view.get("max_lora", max_lora) or 0)
        for st in w.registry.jobs.values():
            if st.lora is not None and (not st.admitted or engine_view is None):
                into = running if st.admitted else waiting
                into[st.lora.lora_name] = into.get(st.lora.lora_name, 0) + 1
        a = w.adapters
        return LoRASnapshot(max_lora=max_lora, served=tuple(sorted(a.served)), refused=tuple(sorted(a.refused)),
                            running=running, waiting=waiting, refusals=dict(a.refusals), file_errors=a.file_errors, at=time.time())

    def gauges(self) -> dict[str, float]:
        w = self.w
        g: dict[str, float] = {
            "pending_jobs": len(w.registry.pending),
            "running_jobs": len(w.registry.running()),
            "paused": float(bool(w.pauser and w.pauser.paused)),
            "unfinished_offsets": w.tracker.num_pending(),
        }
        if w.consumer is not None:
            g["assigned_partitions"] = len(w.consumer.assignment())
        # while the engine runs, draining included (the worker is no longer ready then, but its
        # jobs still hold the cache: a drain is when an operator watches these)
        if w.engine is not None and getattr(w.engine, "ready", False):
            cap = w.engine.capacity()
            g.update(kv_free_tokens=cap.free_tokens, kv_total_tokens=cap.total_tokens, engine_running=cap.num_running, engine_waiting=cap.num_waiting)
        return g
