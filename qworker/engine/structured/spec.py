"""What a request asks its output to be: one JSON schema, JSON object, regex, choice or grammar.

Field names follow vLLM's ``StructuredOutputsParams`` (formerly ``GuidedDecodingParams``):
``json`` (a JSON Schema, dict or JSON text), ``regex``, ``choice``, ``grammar`` (EBNF in
xgrammar's dialect, llama.cpp GBNF-like, root rule ``root``) and ``json_object``; exactly one of
them is set. ``strict`` and ``disable_any_whitespace`` only shape ``json``/``json_object`` output.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from qworker.engine.errors import InvalidRequestError

ERROR_CODE = "invalid_structured_output"
# arrays and objects in a JSON schema, one inside another (the checks walk it recursively)
MAX_SCHEMA_DEPTH = 256
MAX_SPEC_CHARS = 1 << 20  # a spec larger than 1 MiB of text is refused before it is compiled
MAX_CHOICES = 1024
KINDS = ("json", "json_object", "regex", "choice", "grammar")

# JSON Schema keywords xgrammar 0.2.8 accepts but does not enforce (measured: a violating
# instance is accepted by the compiled grammar). A schema using one is refused, so that every
# output that finishes validates against the schema it was asked for.
UNENFORCED_KEYWORDS = frozenset(
    {"not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
     "dependentRequired", "dependentSchemas", "dependencies", "oneOf"}
)
# compiled alone by xgrammar: a constraint beside one of them is dropped (measured on 0.2.8)
ALONE = ("$ref", "anyOf", "allOf", "enum", "const")
# the keywords that decide which instances are valid (anything else, "title", "example", "nullable",
# "x-..." and the like, is an annotation the backend ignores everywhere, harmlessly)
CONSTRAINT_KEYWORDS = frozenset({
    "type", "enum", "const", "$ref", "anyOf", "allOf", "oneOf", "not", "if", "then", "else",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames", "unevaluatedProperties",
    "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "dependencies",
    "items", "prefixItems", "additionalItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems",
    "contains", "minContains", "maxContains", "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
# references: only a local "$ref" is resolved; the dynamic and recursive forms are refused too
REF_KEYWORDS = frozenset({"$ref", "$dynamicRef", "$recursiveRef"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "unevaluatedItems", "additionalItems", "propertyNames", "items")
_SCHEMA_LISTS = ("anyOf", "allOf", "prefixItems", "items")


class StructuredOutputError(InvalidRequestError):
    """A spec that can never be served (bad input, unsupported feature, compile timeout); not retryable."""

    def __init__(self, message: str):
        super().__init__(ERROR_CODE, message)


@dataclass(slots=True, frozen=True, eq=False)
class StructuredOutputsParams:
    """Validated at construction; ``key`` is a sha256 over a canonical JSON form (the cache key).

    ``strict`` (json only): True (default) never generates a property or item the schema does not
    name, even where the schema would allow extra ones (xgrammar's ``strict_mode``); False follows
    the schema's own ``additionalProperties``. ``disable_any_whitespace``: compact JSON, no free
    whitespace between tokens (small models otherwise tend to spend their budget on newlines).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    strict: bool = True
    disable_any_whitespace: bool = False
    key: str = field(init=False, repr=False)
    schema: dict | None = field(init=False, repr=False)  # ``json`` parsed (a private copy)
    # set by the compiler service when this object's grammar is compiled (or refused): the
    # request holding the spec keeps its grammar even if the shared cache evicts it meanwhile
    compiled: object = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        # a kind is set when given at all (json=False is a boolean schema, refused as such below),
        # json_object when true
        set_ = [k for k in KINDS if (self.json_object is True if k == "json_object" else getattr(self, k) is not None)]
        if len(set_) != 1:
            raise StructuredOutputError(f"exactly one of {', '.join(KINDS)} must be set, got {set_ or 'none'}")
        if not isinstance(self.strict, bool) or not isinstance(self.disable_any_whitespace, bool):
            raise StructuredOutputError("strict and disable_any_whitespace must be booleans")
        kind = set_[0]
        value: object = True
        schema = None
        if kind == "json":
            schema = _parse_schema(self.json)
            try:
                check_schema_supported(schema, root=schema)
            except RecursionError:  # a long chain of $refs, each followed by one more call
                raise StructuredOutputError("json schema's $ref chain is too long to check") from None
            value = schema
        elif kind == "json_object":
            if self.json_object is not True:
                raise StructuredOutputError("json_object must be true")
        elif kind in ("regex", "grammar"):
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise StructuredOutputError(f"{kind} must be a non-empty string")
            if len(text) > MAX_SPEC_CHARS:
                raise StructuredOutputError(f"{kind} is {len(text)} characters; at most {MAX_SPEC_CHARS}")
            if kind == "regex":
                check_regex_supported(text)
            value = text
        else:
            choices = _check_choices(self.choice)
            object.__setattr__(self, "choice", choices)
            value = sorted(set(choices))  # order and repeats do not change the language
        shape = {"compact": self.disable_any_whitespace} if kind in ("json", "json_object") else {}
        if kind == "json":
            shape["strict"] = self.strict
        canon = json.dumps({"kind": kind, "value": value, **shape}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        try:
            encoded = canon.encode()
        except UnicodeEncodeError:  # valid JSON ("\ud800") but not text: no grammar can hold it
            raise StructuredOutputError(f"{kind} holds a lone UTF-16 surrogate, which is not a character") from None
        object.__setattr__(self, "schema", schema)
        object.__setattr__(self, "key", hashlib.sha256(encoded).hexdigest())

    @property
    def kind(self) -> str:
        for k in KINDS:
            if k == "json_object":
                if self.json_object:
                    return k
            elif getattr(self, k) is not None:
                return k
        raise AssertionError("validated in __post_init__")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StructuredOutputsParams) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


def from_response_format(rf: object) -> StructuredOutputsParams | None:
    """A job's ``response_format`` -> spec (None for plain text). OpenAI's shapes:
    ``{"type": "text"}``, ``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}``; and a proposal for qworker's own: ``{"type": "regex",
    "regex": str}``, ``{"type": "choice", "choice": [str]}``, ``{"type": "grammar", "grammar":
    str}``. An absent ``strict`` means True here: decoding is constrained either way, and strict
    only keeps the model from inventing properties the schema does not name."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise StructuredOutputError("response_format must be an object with a string 'type'")
    kind = rf["type"]
    extra = set(rf) - {"type", kind}
    if extra:
        raise StructuredOutputError(f"response_format of type {kind!r} has unknown fields {sorted(extra)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise StructuredOutputError("response_format json_schema needs a 'json_schema' object with a 'schema'")
        unknown = set(js) - {"name", "description", "schema", "strict"}
        if unknown:
            raise StructuredOutputError(f"response_format json_schema has unknown fields {sorted(unknown)}")
        strict = js.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise StructuredOutputError("response_format json_schema.strict must be a boolean")
        return StructuredOutputsParams(json=js["schema"], strict=True if strict is None else strict)
    if kind in ("regex", "choice", "grammar"):
        if kind not in rf:
            raise StructuredOutputError(f"response_format of type {kind!r} needs a {kind!r} field")
        return StructuredOutputsParams(**{kind: rf[kind]})
    raise StructuredOutputError(f"response_format type must be one of text, json_object, json_schema, regex, choice, grammar; got {kind!r}")


def _nesting(value: object, limit: int) -> int:
    """How many arrays and objects deep ``value`` goes, counted without recursion, up to the
    first level past ``limit`` (a dict that contains itself, which the Python API can be given,
    has no end)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            break
        todo.extend((x, depth + 1) for x in v)
    return deepest


def _parse_schema(value: object) -> dict:
    if isinstance(value, str):
        if len(value) > MAX_SPEC_CHARS:
            raise StructuredOutputError(f"json schema is {len(value)} characters; at most {MAX_SPEC_CHARS}")
        try:
            value = json.loads(value)
        except RecursionError:
            raise StructuredOutputError(f"json schema nests more than {MAX_SCHEMA_DEPTH} levels deep") from None
        except ValueError as e:
            raise StructuredOutputError(f"json schema is not valid JSON: {e}") from e
    if _nesting(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:  # the checks and copies below recurse; a real schema is nowhere near
        raise StructuredOutputError(f"json schema nests more than {MAX_SCHEMA_DEPTH} levels deep")
    if isinstance(value, bool):  # true / false are valid schemas, but not useful ones
        raise StructuredOutputError("json schema must be an object, not a boolean")
    if not isinstance(value, dict):
        raise StructuredOutputError(f"json schema must be an object, got {type(value).__name__}")
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise StructuredOutputError(f"json schema is not JSON-serialisable: {e}") from e
    if len(text) > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"json schema is {len(text)} characters; at most {MAX_SPEC_CHARS}")
    return json.loads(text)  # a private copy: the caller's dict may change, the key must not


def check_schema_supported(schema: object, path: str = "#", root: object = None, seen: set | None = None) -> None:
    """Raise for what xgrammar would accept without enforcing, anywhere a subschema can be
    (property names and ``enum``/``const`` values are data, not keywords, and are not looked into):
    a keyword in ``UNENFORCED_KEYWORDS``; a constraint beside a keyword xgrammar compiles alone
    (``ALONE``); ``required`` naming a property ``properties`` does not define; a ``$ref`` that is
    not local to the schema (xgrammar resolves only ``#`` and ``#/...`` and would quietly allow any
    JSON for another one) or that points nowhere. Each local reference's target is checked too,
    wherever in ``root`` it lies. Nothing is ever fetched."""
    if not isinstance(schema, dict):
        return
    root = schema if root is None else root
    seen = set() if seen is None else seen
    for kw in REF_KEYWORDS & schema.keys():
        ref = schema[kw]
        if kw != "$ref" or not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise StructuredOutputError(
                f"JSON Schema {kw} {ref!r} at {path} is not supported: only local references ('#' or '#/...') are resolved, "
                "nothing is fetched; inline the referenced schema (under $defs)")
        if ref not in seen:
            seen.add(ref)
            check_schema_supported(_resolve(root, ref, path), ref, root, seen)
    for kw in sorted(UNENFORCED_KEYWORDS & schema.keys()):
        if kw == "uniqueItems" and schema[kw] is False:
            continue
        hint = " (use anyOf)" if kw == "oneOf" else ""
        raise StructuredOutputError(f"JSON Schema keyword {kw!r} at {path} is not supported by the structured-output backend{hint}")
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise StructuredOutputError(f"JSON Schema 'allOf' with more than one subschema at {path} is not supported by the structured-output backend")
    _check_alone(schema, path)
    _check_combinations(schema, path)
    # a string's pattern (and a patternProperties name) goes through the same regex dialect: an
    # anchor inside it is ignored there, so "^a$b" (which nothing matches) would serve "ab"
    patterns = [schema["pattern"]] if isinstance(schema.get("pattern"), str) else []
    if isinstance(schema.get("patternProperties"), dict):
        patterns += list(schema["patternProperties"])
    for pattern in patterns:
        what = f"JSON Schema pattern {pattern[:80]!r} at {path}:"
        _check_letter_escapes(pattern, what)
        _check_edge_anchors(_regex_tokens(pattern), what)
        if _may_match_unescaped(pattern):
            raise StructuredOutputError(f"{what} it can match '\"', '\\' or a control character, which the structured-output "
                                        "backend writes into the JSON string unescaped (invalid JSON); exclude them from the pattern")
    required, props = schema.get("required"), schema.get("properties")
    if isinstance(required, list):
        missing = [r for r in required if not isinstance(props, dict) or r not in props]
        if missing:
            raise StructuredOutputError(f"JSON Schema 'required' at {path} names {missing[:3]}, which 'properties' does not define: "
                                        "the structured-output backend only generates properties the schema defines")
    for kw in _SCHEMA_MAPS:
        sub = schema.get(kw)
        if isinstance(sub, dict):
            for name, s in sub.items():
                check_schema_supported(s, f"{path}/{kw}/{name}", root, seen)
    for kw in _SCHEMA_ONE:
        check_schema_supported(schema.get(kw), f"{path}/{kw}", root, seen)
    for kw in _SCHEMA_LISTS:
        sub = schema.get(kw)
        if isinstance(sub, list):
            for i, s in enumerate(sub):
                check_schema_supported(s, f"{path}/{kw}/{i}", root, seen)


def _check_alone(schema: dict, path: str) -> None:
    """xgrammar compiles a ``$ref``, ``anyOf``, ``allOf``, ``enum`` or ``const`` alone and drops what
    stands beside it: no other constraint may (annotations may, and ``type`` beside ``enum``/``const``
    when every value has that type, the common way of writing them)."""
    for kw in ALONE:
        if kw not in schema:
            continue
        beside = sorted((schema.keys() & CONSTRAINT_KEYWORDS) - {kw})
        if kw in ("enum", "const") and beside == ["type"]:
            values = schema[kw] if kw == "enum" and isinstance(schema[kw], list) else [schema[kw]]
            if all(_has_type(v, schema["type"]) for v in values):
                continue
            raise StructuredOutputError(f"JSON Schema {kw!r} at {path} holds a value that is not of its 'type'")
        if beside:
            raise StructuredOutputError(f"JSON Schema {beside[:3]} beside {kw!r} at {path} is not supported: the structured-output "
                                        f"backend compiles {kw!r} alone; move the constraint into the subschemas or values")


# pairs xgrammar 0.2.8 accepts and then enforces only one of (measured by helper-62: outputs that
# finished and failed validation), with what to say
_UNENFORCED_PAIRS = (
    (("pattern", "minLength"), "a length beside a pattern is ignored; put the length in the pattern"),
    (("pattern", "maxLength"), "a length beside a pattern is ignored; put the length in the pattern"),
    (("format", "minLength"), "a length beside a format is ignored"),
    (("format", "maxLength"), "a length beside a format is ignored"),
    (("format", "pattern"), "a pattern beside a format is ignored"),
    (("properties", "propertyNames"), "propertyNames is not applied to the names 'properties' declares"),
)


def _check_combinations(schema: dict, path: str) -> None:
    for pair, why in _UNENFORCED_PAIRS:
        if all(k in schema for k in pair):
            raise StructuredOutputError(f"JSON Schema {pair[0]!r} with {pair[1]!r} at {path} is not supported by the "
                                        f"structured-output backend: {why}")
    if "multipleOf" in schema and schema.get("type") not in ("integer", ["integer"]):
        raise StructuredOutputError(f"JSON Schema 'multipleOf' at {path} is enforced for integers only (\"type\": \"integer\")")
    props, pattern_props = schema.get("properties"), schema.get("patternProperties")
    if isinstance(props, dict) and isinstance(pattern_props, dict):
        both = _matched_by_both(list(props), list(pattern_props))
        if both:
            raise StructuredOutputError(f"JSON Schema property {both[0]!r} at {path} is matched by patternProperties "
                                        f"{both[1][:80]!r} too: the structured-output backend applies only its 'properties' "
                                        "schema; make the pattern exclude it")


def _matched_by_both(names: list[str], patterns: list[str]) -> tuple[str, str] | None:
    """A declared property name that a patternProperties regex also matches (searched with the
    ``regex`` module under a time limit: a pattern from a request is never run unbounded; one that
    times out counts as matching)."""
    import regex  # transformers' own dependency

    for pattern in patterns:
        try:
            rx = regex.compile(pattern)
        except regex.error:
            continue  # the compile refuses it with its own message
        for name in names:
            try:
                if rx.search(name, timeout=0.05):
                    return name, pattern
            except TimeoutError:
                return name, pattern
    return None


_JSON_RAW = (0x22, 0x5C)  # '"' and '\\'; and every control character below 0x20
_ESCAPED_CONTROL = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "a": 7, "e": 27, "0": 0}
# the letter escapes xgrammar's regex dialect knows (classes, controls, \cX, and \x \u \U in the
# forms of _HEX_ESCAPES) or refuses itself (\b outside a class; inside one it is a backspace); it
# matches any other escaped letter as the letter itself, which no other dialect does (\h, \R, \Q
# mean something else in PCRE and are errors in Python's re; \p{L} inside a class serves "p{L}").
# \A \Z \z \G are refused as anchors.
_KNOWN_LETTER_ESCAPES = frozenset("adefnrstvwDSWcbxuU")
# the digits each hex escape must have for xgrammar to read it as a code point (\x{41} is an "x")
_HEX_ESCAPES = {"x": re.compile(r"[0-9a-fA-F]{2}"), "u": re.compile(r"[0-9a-fA-F]{4}|\{[0-9a-fA-F]{1,6}\}"),
                "U": re.compile(r"[0-9a-fA-F]{8}")}


def _unsafe(cp: int) -> bool:
    return cp < 0x20 or cp in _JSON_RAW


def _escape_at(p: str, i: int, in_class: bool = False) -> tuple[int | None, int]:
    """The codepoint the escape at ``p[i] == '\\'`` stands for (None for a class such as ``\\d``)
    and the index after it; inside a class ``\\b`` is a backspace."""
    x = p[i + 1:i + 2]
    if x == "c" and p[i + 2:i + 3].isascii() and p[i + 2:i + 3].isalpha():
        return ord(p[i + 2]) & 31, i + 3  # \cJ: a control character
    if x == "b" and in_class:
        return 8, i + 2
    if x in _HEX_ESCAPES:  # \x41 \u0041 \u{41} \U00000041
        digits = _HEX_ESCAPES[x].match(p, i + 2)
        return (int(digits.group().strip("{}"), 16), digits.end()) if digits else (None, i + 2)
    if x in _ESCAPED_CONTROL:
        return _ESCAPED_CONTROL[x], i + 2
    if x.isalnum() or not x:
        return None, i + 2  # \d \w \s \S \b ...: classes and assertions
    return ord(x), i + 2  # an escaped literal: \" \\ \. \[ ...


def _class_may_match_unescaped(pattern: str, i: int) -> tuple[bool, int]:
    """For the class opening at ``pattern[i] == '['``: whether it holds an unsafe character (only
    a positive class can: see :func:`_may_match_unescaped`), and the index after it."""
    n = len(pattern)
    j = i + 1
    negated = pattern[j:j + 1] == "^"
    j += negated
    first, prev, ranged = True, None, False
    while j < n and (pattern[j] != "]" or first):
        first = False
        escaped = pattern[j] == "\\"
        cp, j = _escape_at(pattern, j, in_class=True) if escaped else (ord(pattern[j]), j + 1)
        if ranged and prev is not None and cp is not None:
            if not negated and (prev < 0x20 or any(prev <= u <= cp for u in _JSON_RAW)):
                return True, j
            ranged, prev = False, None
        elif not escaped and cp == ord("-") and prev is not None and j < n and pattern[j] != "]":
            ranged = True
        elif not negated and cp is not None and _unsafe(cp):
            return True, j
        else:
            prev = cp
    return False, j + 1


def _may_match_unescaped(pattern: str) -> bool:
    """Whether a JSON Schema pattern can match '"', '\\' or a control character where xgrammar
    writes what it matches into the JSON string as is: a literal, an escape standing for one, or
    a positive class holding one (a negated class, ``.`` and ``\\S`` exclude them there)."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            cp, i = _escape_at(pattern, i)
            if cp is not None and _unsafe(cp):
                return True
        elif c == "[":
            unsafe, i = _class_may_match_unescaped(pattern, i)
            if unsafe:
                return True
        else:
            if _unsafe(ord(c)):
                return True
            i += 1
    return False


def _has_type(value: object, types: object) -> bool:
    names = types if isinstance(types, list) else [types]
    checks = {"string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
              "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())}
    return any(name in checks and checks[name](value) for name in names)


def _resolve(root: object, ref: str, path: str) -> object:
    """The subschema a local JSON pointer (``#/a/b``, RFC 6901 escapes) names in ``root``."""
    node = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise StructuredOutputError(f"JSON Schema $ref {ref!r} at {path} points to nothing in the schema")
    return node


def check_regex_supported(regex: str) -> None:
    """Raise for what xgrammar's regex dialect does not know: it reads ``\\A``, ``\\Z``, ``\\z``,
    ``\\G`` and other unknown letter escapes (``\\h``, ``\\R``) as letters and ignores ``^`` and
    ``$`` (with a warning). The whole output matches the regex anyway, so an anchor that can only
    stand where the output starts (``^``) or ends (``$``) changes nothing and is accepted
    (``^yes$|^no$``, ``(^a|^b)c$``); one with something to match before or after it (``a$b``) is
    refused."""
    _check_letter_escapes(regex, "regex")
    _check_edge_anchors(_regex_tokens(regex), "regex")


def _check_letter_escapes(regex: str, what: str) -> None:
    """Raise for an escaped letter the backend would match as the letter itself (inside a class
    too): the anchors ``\\A \\Z \\z \\G``, and ``\\h`` or ``\\R``, which would serve "h" or "R"."""
    i = regex.find("\\")
    while i != -1:
        x = regex[i + 1:i + 2]
        if x in ("A", "Z", "z", "G"):
            raise StructuredOutputError(f"{what} anchor \\{x} is not supported: the whole output matches the regex "
                                        "(a ^ where it starts and a $ where it ends are accepted)")
        if x.isascii() and x.isalpha() and x not in _KNOWN_LETTER_ESCAPES:
            raise StructuredOutputError(f"{what} escape \\{x} is not supported by the structured-output backend (it would "
                                        f"match the letter {x!r} itself); write the characters it stands for instead")
        if x in _HEX_ESCAPES and not _HEX_ESCAPES[x].match(regex, i + 2):
            raise StructuredOutputError(f"{what} escape \\{x} must be followed by its hex digits (\\xHH, \\uHHHH or \\u{{H..}}, "
                                        f"\\UHHHHHHHH): the structured-output backend would match the letter {x!r} itself")
        i = regex.find("\\", i + 2)


def _check_edge_anchors(tokens: list[tuple[str, str]], what: str) -> None:
    """Raise where a ``^`` has something to match on its left or a ``$`` on its right (xgrammar
    ignores both and would serve text the regex can never match)."""
    mirrored = [(t, _MIRROR.get(k, k)) for t, k in reversed(tokens)]  # read from the end: a close opens
    for anchor, order in (("^", tokens), ("$", mirrored)):
        at_edge, saved = True, []  # nothing consumed yet on this path; the flag at each open group
        for t, kind in order:
            if t == anchor:
                if not at_edge:
                    raise StructuredOutputError(f"{what} anchor {anchor!r} with something to match on its "
                                                f"{'left' if anchor == '^' else 'right'} is not supported: the whole "
                                                "output matches the regex, so '^' may only stand where it starts and '$' where it ends")
            elif kind == "open":
                saved.append(at_edge)
            elif kind == "alt":
                at_edge = saved[-1] if saved else True
            elif kind == "close":
                at_edge = False
                if saved:
                    saved.pop()
            elif t not in ("^", "$"):
                at_edge = False


_MIRROR = {"open": "close", "close": "open"}


def _regex_tokens(regex: str) -> list[tuple[str, str]]:
    """``regex`` as (text, kind) tokens: "open" (a group opener: ``(``, ``(?:``, ``(?P<n>``...),
    "close", "alt" (``|``), or "atom" (a character, escape, class or quantifier)."""
    out, i, n = [], 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            out.append((regex[i:i + 2], "atom"))
            i += 2
        elif c == "[":
            j = i + 1 + (regex[i + 1:i + 2] == "^")
            j += regex[j:j + 1] == "]"  # a ']' first in a class is literal
            while j < n and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            out.append((regex[i:j + 1], "atom"))
            i = j + 1
        elif c == "(":
            j = i + 1
            if regex[j:j + 1] == "?":  # (?:  (?P<name>  (?<name>  and the like: up to the group's body
                k = regex.find(">", j) if regex[j + 1:j + 3] in ("P<", "<") or regex[j + 1:j + 2] == "<" else j + 1
                j = (k if k != -1 else j + 1) + 1
            out.append(("(", "open"))
            i = j
        elif c == ")":
            out.append((")", "close"))
            i += 1
        elif c == "|":
            out.append(("|", "alt"))
            i += 1
        else:
            out.append((c, "atom"))
            i += 1
    return out


def _check_choices(choices: object) -> tuple[str, ...]:
    if isinstance(choices, str) or not isinstance(choices, Iterable):
        raise StructuredOutputError("choice must be a list of strings")
    out = tuple(choices)
    if not out or len(out) > MAX_CHOICES:
        raise StructuredOutputError(f"choice must hold 1 to {MAX_CHOICES} strings, got {len(out)}")
    if not all(isinstance(c, str) and c for c in out):
        raise StructuredOutputError("every choice must be a non-empty string")
    if sum(len(c) for c in out) > MAX_SPEC_CHARS:
        raise StructuredOutputError(f"choices total more than {MAX_SPEC_CHARS} characters")
    return out


def choice_to_ebnf(choices: Iterable[str]) -> str:
    """An EBNF grammar whose language is exactly the given strings."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in sorted(set(choices)))


def _ebnf_literal(s: str) -> str:
    out = []
    for ch in s:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
