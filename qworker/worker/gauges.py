"""Gauges: the loop-owned state handed to the metrics (scrapes run on another thread).

Owns nothing: it reads the consumer, the offset tracker, the registry, the LoRA adapter table and
the engine's capacity on the worker's loop and writes them into ``WorkerMetrics``, which a scrape reads.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from qworker.telemetry.lora_metrics import LoRASnapshot

if TYPE_CHECKING:
    from qworker.worker.app import Worker


class Gauges:
    def __init__(self, worker: Worker):
        self.w = worker

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
                if hw is not None and c is not None:
                    w.metrics.set_consumer_lag(tp.topic, tp.partition, hw - c)
        w.metrics.retain_consumer_lag(owned)
        # job outcomes are counted by qworker:jobs_total{outcome}; these are the rest
        counters = {k: v for k, v in asdict(w.stats).items() if k not in ("completed", "cancelled", "errors", "dlq", "abandoned")}
        w.metrics.update_worker(counters, self.gauges())
        if w.settings.lora_enabled:
            w.metrics.lora.update(self.lora())

    def lora(self) -> LoRASnapshot:
        """Jobs per adapter: running = handed to the engine, waiting = queued in the worker."""
        w = self.w
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for st in w.registry.jobs.values():
            if st.lora is not None:
                into = running if st.admitted else waiting
                into[st.lora.lora_name] = into.get(st.lora.lora_name, 0) + 1
        a = w.adapters
        cfg = getattr(getattr(w.engine, "engine", None), "config", None)
        return LoRASnapshot(max_lora=int(getattr(cfg, "max_loras", 0) or 0), served=tuple(sorted(a.served)), refused=tuple(sorted(a.refused)),
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
        if w.engine is not None and w.ready:
            cap = w.engine.capacity()
            g.update(kv_free_tokens=cap.free_tokens, kv_total_tokens=cap.total_tokens, engine_running=cap.num_running, engine_waiting=cap.num_waiting)
        return g
