"""Structured JSON logs: one object per line, with the current span's trace and span ids.

Fields: ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``msg``, ``trace_id``/``span_id`` (hex,
only inside a valid span context, so logs join traces in the backend), ``exc`` for exceptions,
and whatever the caller passed as ``extra=`` (job id, outcome, code, ...). Values that JSON
cannot carry are written with ``str()`` rather than dropping the line.
"""

from __future__ import annotations

import logging
import sys
from datetime import datetime, timezone
from typing import Any

import orjson
from opentelemetry import trace

# attributes every LogRecord has; anything else on a record came from ``extra=``
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            out["trace_id"] = format(ctx.trace_id, "032x")
            out["span_id"] = format(ctx.span_id, "016x")
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def configure_json_logging(level: int | str = logging.INFO, stream: Any = None) -> logging.Handler:
    """Replaces the root logger's handlers with one JSON handler on ``stream`` (stderr)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def log_job_outcome(logger: logging.Logger, job_id: str, outcome: str, *, code: str | None = None, **fields: Any) -> None:
    """The one line per finished job: ``job finished`` with job id, outcome and error code plus
    any numbers the caller has (tokens, seconds, partition/offset). Errors log at warning."""
    extra = {"job_id": job_id, "outcome": outcome, **fields}
    if code:
        extra["code"] = code
    level = logging.WARNING if outcome in ("error", "dlq") else logging.INFO
    logger.log(level, "job finished", extra=extra)
