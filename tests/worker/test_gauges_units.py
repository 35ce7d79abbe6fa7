"""The worker's engine gauges (KV tokens, engine queue) are reported while the engine runs,
draining included: the worker stops being ready when SIGTERM starts the drain, but its jobs still
hold the cache then (helper-113: the series vanished from /metrics for the whole drain)."""

from __future__ import annotations

from types import SimpleNamespace

from qworker.engine.introspection import Capacity
from qworker.worker.gauges import Gauges


def worker(engine_ready: bool, worker_ready: bool) -> SimpleNamespace:
    # the worker's shape as Gauges.gauges reads it; the engine's capacity is a real snapshot type
    engine = SimpleNamespace(ready=engine_ready, capacity=lambda: Capacity(free_tokens=40, total_tokens=100, block_size=16,
                                                                            num_running=2, num_waiting=1))
    return SimpleNamespace(registry=SimpleNamespace(pending=[], running=lambda: [1, 2]), pauser=None, consumer=None,
                           tracker=SimpleNamespace(num_pending=lambda: 0), engine=engine, ready=worker_ready)


def test_engine_gauges_are_reported_while_draining():
    g = Gauges(worker(engine_ready=True, worker_ready=False)).gauges()
    assert (g["kv_free_tokens"], g["kv_total_tokens"], g["engine_running"], g["engine_waiting"]) == (40, 100, 2, 1)
    assert g["running_jobs"] == 2


def test_no_engine_gauges_before_the_engine_runs_or_after_it_stopped():
    g = Gauges(worker(engine_ready=False, worker_ready=False)).gauges()
    assert "kv_free_tokens" not in g and "engine_running" not in g
