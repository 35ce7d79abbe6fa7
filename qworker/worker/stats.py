"""Worker counters and gauges, rendered in the Prometheus text format."""

from __future__ import annotations

from dataclasses import dataclass, fields


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

    def render(self, gauges: dict[str, float]) -> str:
        lines = []
        for f in fields(self):
            name = f"qworker_{f.name}_total"
            lines += [f"# TYPE {name} counter", f"{name} {getattr(self, f.name)}"]
        for name, value in gauges.items():
            lines += [f"# TYPE qworker_{name} gauge", f"qworker_{name} {value}"]
        return "\n".join(lines) + "\n"
