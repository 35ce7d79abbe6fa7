"""Check JSON of any depth without recursion, and read a few top-level string fields on the way.

The decoders (orjson, then the stdlib) refuse valid JSON nested deeper than about a thousand
levels. Such a record still names its job, and a job with an id must be answered, so the
decoder's refusal cannot be the last word: ``scan`` validates the whole text with an explicit
stack (memory grows with the depth, the call stack does not), in time linear in its length,
and hands back the top-level object's values for the keys asked for, when they are strings.
"""

from __future__ import annotations

import json.decoder
import re
from dataclasses import dataclass, field

_WS = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_OPEN_RUN = re.compile(r"\[(?:[ \t\n\r]*\[)*")  # a run of '[': one step for the usual deep shape
_LITERALS = ("true", "false", "null")


class NotJson(ValueError):
    pass


@dataclass(slots=True)
class Scanned:
    is_object: bool  # the top-level value is an object
    fields: dict[str, object] = field(default_factory=dict)  # top-level keys asked for -> value (str), or None when not a string
    depth: int = 0  # the deepest nesting of objects/arrays


def scan(raw: bytes | str, keys: frozenset[str] | set[str] = frozenset()) -> Scanned:
    """Validate ``raw`` as one JSON value (RFC 8259; surrounding whitespace allowed). Raises
    ``NotJson`` when it is not. For a top-level object, ``fields`` has the last value of each
    key in ``keys`` it holds (as a JSON object's duplicate keys are read): the string, or None
    when the value is not a string."""
    try:
        s = raw.decode("utf-8") if isinstance(raw, bytes) else raw
    except UnicodeDecodeError as e:
        raise NotJson(f"not UTF-8: {e}") from None
    n = len(s)
    stack: list[str] = []  # '{' or '[' per open container
    top_key: str | None = None  # the asked-for top-level key whose value is being read
    i = _WS.match(s, 0).end()
    out = Scanned(is_object=s.startswith("{", i))
    state = _VALUE
    while True:
        i = _WS.match(s, i).end()
        if state is _AFTER:
            if not stack:
                if i < n:
                    raise NotJson(f"extra data at {i}")
                return out
            if i >= n:
                raise NotJson("unexpected end of text")
            c = s[i]
            if c == ",":
                i += 1
                top_key = None
                state = _KEY if stack[-1] == "{" else _VALUE
            elif c == "]" or c == "}":
                if stack.pop() != ("[" if c == "]" else "{"):
                    raise NotJson(f"mismatched {c!r} at {i}")
                i += 1
            else:
                raise NotJson(f"expected ',' or a closing bracket at {i}")
            continue
        if i >= n:
            raise NotJson("unexpected end of text")
        c = s[i]
        if state is _FIRST_ITEM or state is _FIRST_KEY:
            if c == ("]" if state is _FIRST_ITEM else "}"):
                stack.pop()
                i += 1
                state = _AFTER
            else:
                state = _VALUE if state is _FIRST_ITEM else _KEY
            continue
        if state is _KEY:
            if c != '"':
                raise NotJson(f"expected a key at {i}")
            k, i = _string(s, i)
            i = _WS.match(s, i).end()
            if not s.startswith(":", i):
                raise NotJson(f"expected ':' at {i}")
            i += 1
            if len(stack) == 1 and k in keys:
                top_key = k
                out.fields[k] = None  # until a string value says otherwise
            state = _VALUE
            continue
        # _VALUE
        if c == "[":
            m = _OPEN_RUN.match(s, i)
            stack += ["["] * m.group().count("[")
            out.depth = max(out.depth, len(stack))
            i = m.end()
            state = _FIRST_ITEM
        elif c == "{":
            stack.append("{")
            out.depth = max(out.depth, len(stack))
            i += 1
            state = _FIRST_KEY
        else:
            value, i = _scalar(s, i)
            if top_key is not None and len(stack) == 1:
                out.fields[top_key] = value if isinstance(value, str) else None
            state = _AFTER


_VALUE, _AFTER, _KEY, _FIRST_ITEM, _FIRST_KEY = (object() for _ in range(5))


def _string(s: str, i: int) -> tuple[str, int]:
    try:
        return json.decoder.scanstring(s, i + 1, True)
    except ValueError as e:
        raise NotJson(str(e)) from None


def _scalar(s: str, i: int) -> tuple[object, int]:
    if s[i] == '"':
        return _string(s, i)
    if m := _NUMBER.match(s, i):
        return None, m.end()
    for lit in _LITERALS:
        if s.startswith(lit, i):
            return None, i + len(lit)
    raise NotJson(f"unexpected {s[i]!r} at {i}")
