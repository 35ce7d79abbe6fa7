"""JSON log lines with trace and span ids; one line per job outcome."""

from __future__ import annotations

import io
import json
import logging

from qworker.telemetry.logging import JsonFormatter, log_job_outcome


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
