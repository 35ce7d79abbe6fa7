"""Regressions from helper-46's attack on structured output (2026-12-06): specs xgrammar 0.2.8
compiles without enforcing were served, so a job could finish "stop" with output that breaks its
own schema or regex. Each is now refused with ``invalid_structured_output`` before any compile;
the shapes people write every day are still accepted. Before the fixes every ``refused`` case
compiled (and the surrogate one raised a UnicodeEncodeError, answered as ``invalid_prompt``).
The two pattern cases came later (2026-12-06, second session): a schema's ``pattern`` had no
anchor check."""

from __future__ import annotations

import math

import pytest

from qworker.engine.structured.spec import ERROR_CODE, StructuredOutputError, StructuredOutputsParams
from qworker.messages import MIN_LOGPROB, wire_logprob

REFUSED = {
    # xgrammar compiles $ref / anyOf / allOf / enum / const alone and drops what stands beside them
    "a bound beside anyOf": ({"json": {"type": "object", "properties": {"n": {"anyOf": [{"type": "integer", "maximum": 3}], "minimum": 5}}}},
                             "['minimum'] beside 'anyOf' at #/properties/n"),
    "maxLength beside enum": ({"json": {"enum": ["red", "green", "blue"], "maxLength": 2}}, "['maxLength'] beside 'enum'"),
    "maxLength beside $ref": ({"json": {"$defs": {"c": {"type": "string"}}, "$ref": "#/$defs/c", "maxLength": 3}},
                              "['maxLength'] beside '$ref'"),
    "type beside allOf": ({"json": {"type": "integer", "allOf": [{"minimum": 5}]}}, "['type'] beside 'allOf'"),
    "properties beside anyOf": ({"json": {"type": "object", "properties": {"a": {"type": "string"}},
                                          "anyOf": [{"required": ["a"]}]}}, "beside 'anyOf'"),
    "a const of another type": ({"json": {"type": "string", "const": 1}}, "'const' at # holds a value that is not of its 'type'"),
    "an enum value of another type": ({"json": {"type": "integer", "enum": [1, "two"]}}, "'enum' at # holds a value"),
    # required names a property the schema does not define: never generated, so {} came out
    "required, no properties": ({"json": {"type": "object", "required": ["name", "age"]}}, "names ['name', 'age']"),
    "required past properties": ({"json": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a", "b"]}},
                                 "names ['b']"),
    # a $ref's target is checked wherever it lies
    "uniqueItems behind a $ref outside $defs": ({"json": {"$ref": "#/components/tags",
                                                          "components": {"tags": {"type": "array", "uniqueItems": True}}}},
                                                "'uniqueItems' at #/components/tags"),
    "a $ref to nothing": ({"json": {"$ref": "#/$defs/missing"}}, "points to nothing"),
    # anchors xgrammar's regex dialect reads as letters or ignores
    r"\A and \Z": ({"regex": r"\A[0-9]{3}\Z"}, r"anchor \A"),
    r"\z": ({"regex": r"[0-9]+\z"}, r"anchor \z"),
    "a $ inside": ({"regex": "ab$cd"}, "anchor '$'"),
    "a ^ inside": ({"regex": "ab^cd"}, "anchor '^'"),
    "a $ closing a group with more after it": ({"regex": "(a|b$)c"}, "anchor '$'"),
    "a ^ opening a group with something before it": ({"regex": "x(^a)"}, "anchor '^'"),
    # a schema's pattern goes through the same dialect (this session: served "ab" for "^a$b")
    "a $ inside a schema's pattern": ({"json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "^a$b"}}, "required": ["a"]}},
                                      "JSON Schema pattern '^a$b' at #/properties/a: anchor '$'"),
    "a ^ inside a patternProperties name": ({"json": {"type": "object", "patternProperties": {"x^y": {"type": "string"}}}},
                                            "JSON Schema pattern 'x^y' at #: anchor '^'"),
    # pairs xgrammar enforces one half of (helper-62, 2026-12-06 evening: each output finished
    # "stop" and failed jsonschema)
    "a length beside a pattern": ({"json": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}}, "'pattern' with 'maxLength'"),
    "a minimum length beside a pattern": ({"json": {"type": "string", "pattern": "^[a-z]+$", "minLength": 4}}, "'pattern' with 'minLength'"),
    "a length beside a format": ({"json": {"type": "string", "format": "date", "maxLength": 4}}, "'format' with 'maxLength'"),
    "a pattern beside a format": ({"json": {"type": "string", "format": "date", "pattern": "^2"}}, "'format' with 'pattern'"),
    "multipleOf on a number": ({"json": {"type": "number", "multipleOf": 0.5}}, "'multipleOf' at # is enforced for integers only"),
    "propertyNames beside properties": ({"json": {"type": "object", "properties": {"temperature": {"type": "integer"}},
                                                  "propertyNames": {"maxLength": 3}}}, "'properties' with 'propertyNames'"),
    "a name both properties and patternProperties match": (
        {"json": {"type": "object", "properties": {"x-score": {"type": "number"}}, "patternProperties": {"^x-": {"type": "integer"}}}},
        "property 'x-score' at # is matched by patternProperties '^x-'"),
    # a pattern that can match what JSON must escape was served raw (invalid JSON)
    "a quote in a pattern": ({"json": {"type": "string", "pattern": '^say "hi"$'}}, "unescaped"),
    "a tab escape in a pattern": ({"json": {"type": "string", "pattern": r"^a\tb$"}}, "unescaped"),
    "a backslash in a pattern": ({"json": {"type": "string", "pattern": r"^C:\\dir$"}}, "unescaped"),
    "a quote by its code in a pattern": ({"json": {"type": "string", "pattern": r"^\x22$"}}, "unescaped"),
    "a range holding the quote": ({"json": {"type": "string", "pattern": "^[ -~]+$"}}, "unescaped"),
    "a quote in a patternProperties name": ({"json": {"type": "object", "patternProperties": {'^a"b$': {"type": "integer"}}}}, "unescaped"),
    # helper-110: escapes standing for control characters were not seen as such (invalid JSON served)
    "an ESC escape in a pattern": ({"json": {"type": "string", "pattern": r"^\e{2}$"}}, "unescaped"),
    "a control-letter escape in a pattern": ({"json": {"type": "string", "pattern": r"^\cJ{2}$"}}, "unescaped"),
    "a backspace in a pattern's class": ({"json": {"type": "string", "pattern": r"^[\b]{2}$"}}, "unescaped"),
    # helper-110: letter escapes the backend matches as the letter itself ("hhh" served for \h{3})
    "an unknown letter escape in a regex": ({"regex": r"\h{3}"}, "escape \\h is not supported"),
    "PCRE's line-break escapes": ({"regex": r"a\R\N"}, "escape \\R is not supported"),
    "PCRE's quoting": ({"regex": r"\Qa.b\E"}, "escape \\Q is not supported"),
    "an unknown letter escape inside a class": ({"regex": r"[\hx]+"}, "escape \\h is not supported"),
    "an unknown letter escape in a pattern": ({"json": {"type": "string", "pattern": r"^\X+$"}}, "escape \\X is not supported"),
    "an anchor escape in a pattern": ({"json": {"type": "string", "pattern": r"\Aab"}}, "anchor \\A is not supported"),
    # helper-114: letters xgrammar reads literally in some places: \p{L} in a class served "p{L}",
    # \x{41} served 41 x's, \U0041 served "U0041", and \u{22} in a pattern served a raw quote
    "a Unicode property in a class": ({"regex": r"[\p{L}\s]+"}, "escape \\p is not supported"),
    "a negated Unicode property in a class": ({"regex": r"[\P{L}]"}, "escape \\P is not supported"),
    "a non-boundary escape in a class": ({"regex": r"[\B\k]"}, "escape \\B is not supported"),
    "a braced \\x escape": ({"regex": r"\x{41}"}, "escape \\x must be followed by its hex digits"),
    "a short \\U escape": ({"regex": r"a\U0041"}, "escape \\U must be followed by its hex digits"),
    "a braced \\u quote in a pattern": ({"json": {"type": "string", "pattern": r"^\u{22}$"}}, "unescaped"),
    # valid JSON, not text
    "a lone surrogate in a choice": ({"choice": ["ok", "a\ud800"]}, "lone UTF-16 surrogate"),
    "a lone surrogate in a schema": ({"json": {"enum": ["\udfff"]}}, "lone UTF-16 surrogate"),
    "a lone surrogate in a regex": ({"regex": "a\ud800"}, "lone UTF-16 surrogate"),
}

ACCEPTED = {
    "multipleOf on an integer": {"json": {"type": "integer", "multipleOf": 5}},
    "negated classes and escapes that stay inside a JSON string": {"json": {"type": "string", "pattern": r"^[^,\"]+ \d{2}\.\S+$"}},
    "a typed enum": {"json": {"type": "string", "enum": ["a", "b"], "description": "colour"}},
    "integers as floats": {"json": {"type": "integer", "enum": [1, 2.0]}},
    "an Optional field (pydantic)": {"json": {"type": "object", "properties": {"x": {"anyOf": [{"type": "string"}, {"type": "null"}],
                                                                                       "default": None, "title": "X"}}}},
    "a $ref with a description": {"json": {"$defs": {"c": {"type": "string"}}, "type": "object",
                                           "properties": {"a": {"$ref": "#/$defs/c", "description": "d"}}, "required": ["a"]}},
    "a recursive $ref": {"json": {"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
                                  "$ref": "#/$defs/n"}},
    "a one-subschema allOf (pydantic v1)": {"json": {"allOf": [{"$ref": "#/definitions/m"}], "title": "T",
                                                     "definitions": {"m": {"type": "string"}}}},
    "anchors at the ends, ^ and $ in classes, escaped": {"regex": r"^[a-z^$]+\$\^[^]x]$"},
    "a literal backslash before A": {"regex": r"\\A"},
    "the letter escapes the backend knows": {"regex": r"\d\w\s\D\S\W\x41\u0041\U0001F600[\d\t]\n\r\f\v\a\e\cJ[\b]"},
    "a literal backslash before h": {"regex": r"\\h[\\h]"},
    "a braced \\u escape": {"regex": r"[\u{4e00}-\u{9fff}]+"},
    # helper-48: annotations the backend ignores may stand beside $ref / enum
    "an OpenAPI example beside $ref": {"json": {"$ref": "#/$defs/a", "example": {"x": 1}, "$defs": {"a": {"type": "string"}}}},
    "nullable beside $ref (OpenAPI 3.0)": {"json": {"$ref": "#/$defs/a", "nullable": True, "$defs": {"a": {"type": "string"}}}},
    "x-enumNames beside enum": {"json": {"type": "string", "enum": ["a", "b"], "x-enumNames": ["A", "B"]}},
    # helper-48: anchors that can only stand where the output starts or ends change nothing
    "anchors at the ends of alternatives": {"regex": "^yes$|^no$"},
    "anchors at the ends of a group's alternatives": {"regex": r"^(?:\d{3}$|\d{5}$)"},
    "a ^ opening a leading group": {"regex": "(^a|^b)c$"},
    "a schema pattern anchored at its ends": {"json": {"type": "object", "properties": {"z": {"type": "string", "pattern": r"^\d{3}-\d{4}$"}},
                                                       "patternProperties": {"^x-": {"type": "string"}}}},
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_spec_the_backend_would_not_enforce_is_refused(name):
    kwargs, words = REFUSED[name]
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutputsParams(**kwargs)
    assert info.value.code == ERROR_CODE and words in str(info.value)


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_everyday_specs_are_still_accepted(name):
    assert StructuredOutputsParams(**ACCEPTED[name]).key


@pytest.mark.parametrize(("value", "want"), [(-math.inf, MIN_LOGPROB), (math.nan, MIN_LOGPROB), (-1e6, MIN_LOGPROB),
                                             (-0.25, -0.25), (0.0, 0.0)])
def test_logprobs_on_the_wire_are_finite(value, want):
    # a token the grammar masked sits in a top-k list at -inf, which orjson wrote as null
    assert wire_logprob(value) == want


@pytest.mark.parametrize(("shape", "levels"), [("items", 1015), ("properties", 505), ("anyOf", 505), ("string", 1015)])
def test_a_schema_nested_past_the_limit_is_refused_as_structured_output(shape, levels):
    """helper-118: a schema ~1,000 levels deep (under orjson's 1,024, so the job's line parsed)
    raised RecursionError inside the spec's checks, and the worker answered it as
    ``invalid_prompt`` on ``body.prompt``. Now the nesting is measured first, without recursion,
    and over 256 levels is ``invalid_structured_output``; 255 levels of ``items`` still pass."""
    import orjson  # the stdlib's json recurses, and gives up near 1,000 levels under pytest's stack

    from qworker.engine.sampling_params import SamplingParams
    from qworker.engine.structured.spec import from_response_format

    def nested(kind: str, n: int) -> str:
        if kind == "properties":
            return '{"type": "object", "properties": {"a": ' * n + '{"type": "integer"}' + '}}' * n
        if kind == "anyOf":
            return '{"anyOf": [' * n + '{"type": "integer"}' + ']}' * n
        return '{"type": "array", "items": ' * n + '{"type": "integer"}' + '}' * n

    def spec(schema):
        return SamplingParams(max_tokens=3, structured_outputs=from_response_format(
            {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}))

    text = nested(shape, levels)
    with pytest.raises(StructuredOutputError, match="levels deep"):
        spec(text if shape == "string" else orjson.loads(text))
    assert spec(orjson.loads(nested("items", 255))).structured_outputs is not None


@pytest.mark.parametrize("schema", [False, True])
def test_a_boolean_schema_is_refused_for_what_it_is(schema):
    """helper-110 and helper-118: ``"schema": false`` was refused as "exactly one of json, ...
    must be set, got none" (false read as unset), where ``true`` said what was wrong."""
    from qworker.engine.structured.spec import from_response_format

    with pytest.raises(StructuredOutputError, match="not a boolean"):
        from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    with pytest.raises(StructuredOutputError, match="not a boolean"):
        StructuredOutputsParams(json=schema)


def test_a_schema_that_contains_itself_or_a_long_ref_chain_is_refused():
    """helper-121: the nesting count walked a dict that contains itself (the Python API can be
    given one) until memory ran out, where ``json.dumps`` had refused it; and a chain of 1,500
    ``$ref``s, each only a few levels deep, still raised RecursionError in the checks."""
    looped = {"type": "object", "properties": {}}
    looped["properties"]["self"] = looped
    with pytest.raises(StructuredOutputError, match="levels deep"):
        StructuredOutputsParams(json=looped)
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(1500)}
    defs["a1500"] = {"type": "string"}
    with pytest.raises(StructuredOutputError, match="ref chain"):
        StructuredOutputsParams(json={"$defs": defs, "$ref": "#/$defs/a0"})
