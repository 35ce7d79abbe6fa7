"""W3C trace context (``traceparent``/``tracestate``) in Kafka record headers.

aiokafka hands headers over as a sequence of ``(str, bytes | None)`` pairs and takes a list of
``(str, bytes)`` pairs when producing. Kafka allows repeated keys; W3C says a repeated
``traceparent`` is invalid, so we read the first and, when writing, replace any we find.
Keys compare case-insensitively (HTTP carriers are case-insensitive and some producers write
``Traceparent``).

We use the W3C propagator directly rather than the global one: the header names are part of
the wire contract with producers and result readers, not a deployment choice.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, Setter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

Headers = Sequence[tuple[str, bytes | None]]

_PROPAGATOR = TraceContextTextMapPropagator()
TRACE_HEADERS = frozenset(_PROPAGATOR.fields)  # {"traceparent", "tracestate"}


class _HeaderGetter(Getter[Headers]):
    def get(self, carrier: Headers, key: str) -> list[str] | None:
        key = key.lower()
        values = [v.decode("latin-1") for k, v in carrier if v is not None and k.lower() == key]
        return values or None

    def keys(self, carrier: Headers) -> list[str]:
        return [k for k, _ in carrier]


class _HeaderSetter(Setter[list[tuple[str, bytes]]]):
    def set(self, carrier: list[tuple[str, bytes]], key: str, value: str) -> None:
        low = key.lower()
        carrier[:] = [(k, v) for k, v in carrier if k.lower() != low]
        carrier.append((key, value.encode("latin-1")))


_GETTER = _HeaderGetter()
_SETTER = _HeaderSetter()


def extract(headers: Iterable[tuple[str, bytes | None]] | None, context: Context | None = None) -> Context:
    """The context a producer put in ``headers`` (an empty context when there is none or it is
    malformed: a bad ``traceparent`` must never fail a job)."""
    return _PROPAGATOR.extract(list(headers or ()), context=context, getter=_GETTER)


# What we pass on of a producer's tracestate: the 512 characters W3C asks every vendor to
# propagate. The answer's size check leaves HEADER_ROOM (1 KiB) for the trace headers; an 8 KiB
# tracestate (the SDK keeps that much) would push an answer sized under the limit past it.
MAX_TRACESTATE = 512
_LONG_ENTRY = 128


def bounded_tracestate(value: str) -> str:
    """``value`` cut to ``MAX_TRACESTATE`` characters as W3C says to truncate: entries longer than
    128 characters go first, then entries from the end (the newest are at the front)."""
    if len(value) <= MAX_TRACESTATE:
        return value
    entries = [e.strip() for e in value.split(",") if e.strip()]
    entries = [e for e in entries if len(e) <= _LONG_ENTRY]
    while entries and len(",".join(entries)) > MAX_TRACESTATE:
        entries.pop()
    return ",".join(entries)


def inject(headers: list[tuple[str, bytes]] | None = None, context: Context | None = None) -> list[tuple[str, bytes]]:
    """Writes the current (or given) span context into ``headers`` (a new list when None) and
    returns it, its tracestate bounded (:func:`bounded_tracestate`; dropped when nothing is left).
    Nothing is written when there is no valid span context."""
    headers = [] if headers is None else headers
    _PROPAGATOR.inject(headers, context=context, setter=_SETTER)
    for i, (k, v) in enumerate(headers):
        if k.lower() == "tracestate":
            bounded = bounded_tracestate(v.decode("latin-1"))
            if bounded:
                headers[i] = (k, bounded.encode("latin-1"))
            else:
                del headers[i]
            break
    return headers
