"""Hostile values against both log formats: a value that closes its quotes early, a message that
quotes a record's ``key=value``, lone surrogates (the stdlib JSON decoder makes them from
``"\\ud800"``) and the bidi marks. Each failed before its fix."""

from __future__ import annotations

import io
import json
import logging
import re

import pytest

from qworker.telemetry.logging import JsonFormatter, TextFormatter

# one logfmt pair: key=value or key="value with \" and \\ escapes"
_PAIR = re.compile(r' ([A-Za-z_]+)=("(?:[^"\\]|\\.)*"|\S*)')
_HEAD = re.compile(r'^\S+ [A-Z]+ \S+: ("(?:[^"\\]|\\.)*"|[^=]*?)(?= [A-Za-z_]+=|$)')


def _logger(fmt: logging.Formatter) -> tuple[logging.Logger, io.StringIO]:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(fmt)
    log = logging.getLogger(f"qworker.test.attack.{type(fmt).__name__}")
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO)
    return log, buf


def _pairs(line: str) -> list[tuple[str, str]]:
    """A logfmt reader's view of a text line: the message, then every pair after it."""
    head = _HEAD.match(line)
    assert head is not None, line
    return [(m.group(1), m.group(2)) for m in _PAIR.finditer(line, head.end())]


def test_text_value_cannot_close_its_quotes_and_add_a_pair() -> None:
    """Before: quotes were escaped but backslashes were not, so ``a\\" job_id=victim`` became
    ``"a\\\\" job_id=victim ..."``: the backslash escaped itself, the quote closed the value and
    ``job_id=victim`` was a pair of its own."""
    log, buf = _logger(TextFormatter())
    log.warning("job finished", extra={"job_id": 'a\\" job_id=victim x="', "code": "c"})
    pairs = _pairs(buf.getvalue().rstrip("\n"))
    assert [k for k, _ in pairs] == ["job_id", "code"], pairs


def test_text_message_cannot_pass_for_a_pair() -> None:
    """Before: the message was written bare ahead of the pairs, so one quoting a record
    (``... job_id=victim``) put a ``job_id=victim`` pair in front of the real one."""
    log, buf = _logger(TextFormatter())
    log.warning("refused: %s", "x job_id=victim", extra={"job_id": "real"})
    line = buf.getvalue().rstrip("\n")
    assert _pairs(line) == [("job_id", "real")], line
    assert "job_id=victim" in line  # still said, inside the quoted message


@pytest.mark.parametrize("fmt", [TextFormatter(), JsonFormatter()], ids=["text", "json"])
def test_lone_surrogates_and_bidi_marks_are_escaped(fmt: logging.Formatter) -> None:
    """Before: a lone surrogate made the JSON formatter raise (the line was lost, and logging's
    multi-line ``--- Logging error ---`` report went to stderr instead), and the text format
    wrote it raw (no UTF-8 stream can take it); U+200E/U+200F/U+061C reordered the line."""
    log, buf = _logger(fmt)
    errors: list[BaseException] = []
    handler = log.handlers[0]
    handler.handleError = lambda record: errors.append(record)  # type: ignore[method-assign]
    log.warning("value %s", "a\udcffb\u200fc", extra={"job_id": "j\ud800\u061c"})
    assert not errors, "the formatter raised"
    out = buf.getvalue()
    out.encode("utf-8")  # strict: no surrogate reached the stream
    assert not re.search("[\u061c\u200e\u200f]", out)
    if isinstance(fmt, JsonFormatter):
        rec = json.loads(out)
        assert rec["msg"] == "value a\\udcffb\\u200fc" and rec["job_id"] == "j\\ud800\\u061c"
    else:
        assert "value a\\udcffb\\u200fc job_id=j\\ud800\\u061c" in out
