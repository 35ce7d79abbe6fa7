"""Worker counters (exposed as ``qworker:<name>_total`` by ``Gauges.observe``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WorkerStats:
    records: int = 0  # job records fetched (first time)
    refetched: int = 0  # records skipped because we already hold them (after a rebalance)
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    dlq: int = 0
    duplicates: int = 0  # records whose job id was already in flight
    abandoned: int = 0  # runs aborted by revoke or drain, left for the next owner
    pause_events: int = 0
    commits: int = 0
    commit_failures: int = 0
    rebalances: int = 0
