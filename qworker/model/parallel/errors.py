"""The one error tensor parallelism adds: a model executor is gone."""

from __future__ import annotations


class ExecutorFailed(RuntimeError):
    """A rank of the tensor-parallel group died, or a collective with it failed or timed out.

    Fatal for the engine: no request is to blame and none can run any more (every forward needs
    every rank), so it is never handled as a per-request step failure. The engine stops, and the
    worker exits non-zero leaving its unanswered jobs uncommitted for a healthy pod."""
