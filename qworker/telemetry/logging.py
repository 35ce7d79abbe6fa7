"""Log lines, as JSON objects or as text, that nothing logged can forge or corrupt.

Both formatters escape control characters (C0, DEL, C1, the Unicode line and paragraph
separators and the bidirectional overrides) in everything they write: the message after its
arguments are filled in, every ``extra=`` field, exception and stack texts. So a header value, a
job id or an error text taken from a record can never start a new line, hide part of one, or put
a NUL byte in the log, whichever logger wrote it (ours, aiokafka's, OpenTelemetry's warning
about a bad ``tracestate``). Escaping happens here, once, instead of at each call site, where it
would be forgotten.

JSON fields: ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``msg``, ``trace_id``/``span_id``
(hex, inside a valid span context, so logs join traces in the backend), ``exc`` for exceptions,
and whatever the caller passed as ``extra=`` (``job_id``, ``outcome``, ``code``, ...). Values
that JSON cannot carry are written with ``str()`` rather than dropping the line.

Text: ``<ts> <LEVEL> <logger>: <msg> key=value ...`` with the same fields as ``key=value``
pairs (``job_id`` and ``trace_id`` first); an exception's traceback follows on continuation lines
that start with ``  | ``, so every line that does not is the start of a record.
"""

from __future__ import annotations

import logging
import re
import sys
from datetime import datetime, timezone
from typing import Any

import orjson
from opentelemetry import trace

# attributes every LogRecord has; anything else on a record came from ``extra=``
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}

# C0 controls, DEL, C1 controls, line/paragraph separators, bidi marks, embeddings, overrides
# and isolates, and lone surrogates (a str can hold them - the stdlib's JSON decoder makes them
# from "\ud800" - but no UTF-8 stream can: the JSON encoder refused the whole line)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_CONTINUATION = "\n  | "
_FIRST = ("job_id", "trace_id")  # the text format writes these pairs first


def _escape_char(m: re.Match[str]) -> str:
    c = m.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def escape(text: str) -> str:
    """``text`` with every control character written as a visible escape (``\\n``, ``\\x00``,
    ``\\u2028``); other text, backslashes included, is left as it is."""
    return _CONTROL.sub(_escape_char, text)


def clean(value: Any) -> Any:
    """``value`` with every string in it escaped (dict keys, lists and tuples included); other
    values as they are. Bounded by what the caller logs, not by a record."""
    if isinstance(value, str):
        return escape(value)
    if isinstance(value, dict):
        return {escape(str(k)): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return escape(bytes(value).decode("utf-8", "backslashreplace"))
    return value


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """What the caller passed as ``extra=``, escaped."""
    return {escape(k): clean(v) for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


def _message(record: logging.LogRecord) -> str:
    try:
        return escape(record.getMessage())
    except Exception as e:  # noqa: BLE001 - a bad format string must not lose the line
        return escape(f"{record.msg!r} (unformattable with {len(record.args or ())} args: {e!r})")


def _span_ids() -> tuple[str, str] | None:
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


def _ts(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": _ts(record), "level": record.levelname.lower(), "logger": escape(record.name), "msg": _message(record)}
        ids = _span_ids()
        if ids is not None:
            out["trace_id"], out["span_id"] = ids
        for key, value in extra_fields(record).items():
            out.setdefault(key, value)  # a span's ids win over a caller's copy (they agree)
        if record.exc_info:
            out["exc"] = _keep_newlines(self.formatException(record.exc_info))
        if record.stack_info:
            out["stack"] = _keep_newlines(self.formatStack(record.stack_info))
        return orjson.dumps(out, default=lambda v: escape(str(v))).decode()


class TextFormatter(logging.Formatter):
    """``<ts> <LEVEL> <logger>: <msg> key=value ...``, one physical line per record (tracebacks
    on ``  | `` continuation lines)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = extra_fields(record)
        ids = _span_ids()
        if ids is not None and "trace_id" not in fields:
            fields["trace_id"] = ids[0]
        order = [k for k in _FIRST if k in fields] + [k for k in fields if k not in _FIRST]
        pairs = "".join(f" {k}={_text_value(fields[k])}" for k in order)
        line = f"{_ts(record)} {record.levelname} {escape(record.name)}: {_text_message(_message(record))}{pairs}"
        for text in (self.formatException(record.exc_info) if record.exc_info else None, self.formatStack(record.stack_info) if record.stack_info else None):
            if text:
                line += _CONTINUATION + _CONTINUATION.join(escape(part) for part in text.split("\n"))
        return line


def _keep_newlines(text: str) -> str:
    """A multi-line text (a traceback) for a JSON field: newlines stay (JSON escapes them), every
    other control character is escaped."""
    return "\n".join(escape(part) for part in text.split("\n"))


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value, default=lambda v: escape(str(v))).decode() if isinstance(value, (dict, list)) else escape(str(value))
    if text and not any(c in text for c in ' "='):
        return text
    return _quoted(text)


def _quoted(text: str) -> str:
    """``text`` in double quotes, its backslashes and quotes escaped: a value cannot end the
    quotes early (``a\\" job_id=x``) and write a pair of its own after them."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _text_message(message: str) -> str:
    """The message of a text line. It comes before the ``key=value`` pairs, so one that holds
    ``=`` (or starts with a quote) is quoted: a message quoting a record (``... job_id=x``)
    cannot pass for a pair, and every unquoted ``key=`` after the message is one."""
    return _quoted(message) if "=" in message or message.startswith('"') else message


def configure_logging(fmt: str = "json", level: int | str = logging.INFO, stream: Any = None) -> logging.Handler:
    """Replaces the root logger's handlers with one handler on ``stream`` (stderr) writing
    ``fmt`` (``json`` or ``text``) lines: every logger of the process goes through it."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def configure_json_logging(level: int | str = logging.INFO, stream: Any = None) -> logging.Handler:
    """``configure_logging`` in the JSON format."""
    return configure_logging("json", level, stream)


def log_job_outcome(logger: logging.Logger, job_id: str, outcome: str, *, code: str | None = None, **fields: Any) -> None:
    """The one line per finished job: ``job finished`` with job id, outcome and error code plus
    any numbers the caller has (tokens, seconds, partition/offset). Errors log at warning."""
    extra = {"job_id": job_id, "outcome": outcome, **fields}
    if code:
        extra["code"] = code
    level = logging.WARNING if outcome in ("error", "dlq") else logging.INFO
    logger.log(level, "job finished", extra=extra)
