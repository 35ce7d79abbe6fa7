"""Log lines (JSON and text) with trace and span ids, control characters escaped; one line per job outcome."""

from __future__ import annotations

import io
import json
import logging
import re

from qworker.telemetry.logging import JsonFormatter, TextFormatter, log_job_outcome

FORGED = "2026-01-01T00:00:00.000Z INFO qworker.jobs: FORGED"
_LINE_START = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ")


def _logger(buf: io.StringIO) -> logging.Logger:
    handler = logging.StreamHandler(buf)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("qworker.test.json")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger


def test_lines_carry_trace_ids_inside_a_span(tracing):
    buf = io.StringIO()
    log = _logger(buf)
    log.info("outside %s", "span")
    with tracing.tracer.start_as_current_span("process jobs") as span:
        log_job_outcome(log, "job-1", "completed", output_tokens=5, partition=2, offset=9)
        log_job_outcome(log, "job-2", "error", code="prompt_too_long")
        try:
            raise ValueError("bad")
        except ValueError:
            log.exception("failed", extra={"obj": object()})
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert len(lines) == 4
    assert lines[0]["msg"] == "outside span" and "trace_id" not in lines[0]
    ctx = span.get_span_context()
    done = lines[1]
    assert done["msg"] == "job finished" and done["level"] == "info"
    assert done["trace_id"] == format(ctx.trace_id, "032x") and done["span_id"] == format(ctx.span_id, "016x")
    assert (done["job_id"], done["outcome"], done["output_tokens"], done["partition"], done["offset"]) == ("job-1", "completed", 5, 2, 9)
    assert lines[2]["level"] == "warning" and lines[2]["code"] == "prompt_too_long"
    assert "ValueError: bad" in lines[3]["exc"] and lines[3]["obj"].startswith("<object")
    assert lines[0]["ts"].endswith("Z")


def test_formatters_escape_every_field() -> None:
    """Messages, arguments, ``extra=`` fields and exception texts, in both formats. Before: the
    text format wrote them raw (a newline started a forged line, NUL and ESC reached the
    terminal) and the JSON one kept them as JSON escapes of the raw characters."""
    for fmt in (TextFormatter(), JsonFormatter()):
        buf = io.StringIO()
        handler = logging.StreamHandler(buf)
        handler.setFormatter(fmt)
        log = logging.getLogger(f"qworker.test.escape.{type(fmt).__name__}")
        log.handlers[:] = [handler]
        log.propagate = False
        log.setLevel(logging.INFO)  # not the root's: an earlier test's worker may have left it at ERROR
        log.warning("value %s", "a\nb\rc\x1b[31m", extra={"job_id": "j\n1", "code": "x\x85y"})
        try:
            raise ValueError(f"boom\n{FORGED}\x00")
        except ValueError:
            log.exception("failed", extra={"job_id": "j2"})
        out = buf.getvalue()
        assert not re.search("[\x00\x1b\x85\r]", out)
        if isinstance(fmt, TextFormatter):
            lines = out.splitlines()
            assert lines[0].endswith('value a\\nb\\rc\\x1b[31m job_id=j\\n1 code=x\\x85y'), lines[0]
            assert all(_LINE_START.match(ln) or ln.startswith("  | ") for ln in lines) and sum(bool(_LINE_START.match(ln)) for ln in lines) == 2
        else:
            first, second = (json.loads(ln) for ln in out.splitlines())
            assert first["msg"] == "value a\\nb\\rc\\x1b[31m" and first["job_id"] == "j\\n1" and first["code"] == "x\\x85y"
            assert second["job_id"] == "j2" and f"boom\n{FORGED}\\x00" in second["exc"]
