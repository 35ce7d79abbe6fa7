"""The structured-output spec: one kind per request, validated with clear messages, a stable key."""

from __future__ import annotations

import dataclasses
import json

import pytest

from qworker.engine.sampling_params import InvalidRequestError
from qworker.engine.structured import (
    ERROR_CODE,
    GuidedDecodingParams,
    StructuredOutputError,
    StructuredOutputsParams,
    choice_to_ebnf,
    from_response_format,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a"]}


def test_each_kind_and_its_name():
    assert StructuredOutputsParams(json=SCHEMA).kind == "json"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(regex=r"\d+").kind == "regex"
    assert StructuredOutputsParams(choice=["x", "y"]).kind == "choice"
    assert StructuredOutputsParams(grammar='root ::= "a"').kind == "grammar"
    assert GuidedDecodingParams is StructuredOutputsParams  # vLLM's older name


def test_key_is_canonical():
    k = StructuredOutputsParams(json=SCHEMA).key
    reordered = {"required": ["a"], "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "type": "object"}
    assert StructuredOutputsParams(json=reordered).key == k
    assert StructuredOutputsParams(json=json.dumps(SCHEMA, indent=2)).key == k  # JSON text or dict
    assert StructuredOutputsParams(json=SCHEMA, strict=False).key != k
    assert StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).key != k
    assert StructuredOutputsParams(choice=["b", "a", "a"]).key == StructuredOutputsParams(choice=("a", "b")).key
    assert StructuredOutputsParams(regex="a").key != StructuredOutputsParams(grammar="a").key  # the kind is in the key
    assert len(k) == 64 and int(k, 16) >= 0
    assert StructuredOutputsParams(json=SCHEMA) == StructuredOutputsParams(json=reordered)
    assert len({StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json=reordered)}) == 1


def test_the_spec_keeps_its_own_copy_of_the_schema():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    s = StructuredOutputsParams(json=schema)
    key = s.key
    schema["properties"]["a"]["type"] = "string"
    assert s.schema["properties"]["a"]["type"] == "integer" and s.key == key
    assert StructuredOutputsParams(json_object=True, strict=False) == StructuredOutputsParams(json_object=True)
    with pytest.raises(StructuredOutputError, match="not JSON-serialisable"):
        StructuredOutputsParams(json={"type": "number", "maximum": float("nan")})


def test_frozen_and_slots():
    s = StructuredOutputsParams(regex="a")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.regex = "b"  # type: ignore[misc]
    assert not hasattr(s, "__dict__")
    assert StructuredOutputsParams(choice=["x"]).choice == ("x",)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"json": SCHEMA, "json_object": True}, "exactly one of"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"grammar": 3}, "grammar must be a non-empty string"),
        ({"choice": "ab"}, "choice must be a list of strings"),
        ({"choice": []}, "1 to 1024"),
        ({"choice": ["a", ""]}, "non-empty string"),
        ({"choice": ["a", 1]}, "non-empty string"),
        ({"json": "{nope"}, "not valid JSON"),
        ({"json": "[1]"}, "must be an object"),
        ({"json": True}, "not a boolean"),
        ({"json": {"oneOf": [{"type": "integer"}]}}, "'oneOf' at # is not supported"),
        ({"json": {"type": "array", "uniqueItems": True}}, "'uniqueItems'"),
        ({"json": {"type": "object", "properties": {"x": {"type": "array", "items": {"not": {"type": "string"}}}}}}, "'not' at #/properties/x/items"),
        ({"json": {"$defs": {"p": {"if": {}, "then": {}}}}}, "'if' at #/$defs/p"),
        ({"json": {"allOf": [{"type": "object"}, {"required": ["a"]}]}}, "'allOf' with more than one"),
        ({"regex": "a", "strict": 1}, "booleans"),
    ],
)
def test_invalid_specs_say_why(kwargs, words):
    with pytest.raises(StructuredOutputError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.code == ERROR_CODE == "invalid_structured_output"
    assert isinstance(e.value, InvalidRequestError)  # the worker maps these to non-retryable errors
    assert words in str(e.value)


def test_keyword_names_used_as_property_names_are_fine():
    s = StructuredOutputsParams(json={"type": "object", "properties": {"not": {"type": "string"}, "if": {"enum": [{"oneOf": 1}]}}})
    assert s.schema["properties"]["not"] == {"type": "string"}
    StructuredOutputsParams(json={"type": "array", "uniqueItems": False, "minItems": 1})  # uniqueItems false asks nothing


def test_choice_grammar_escapes():
    g = choice_to_ebnf(['say "hi"', "back\\slash", "new\nline"])
    assert '"say \\"hi\\""' in g and '"back\\\\slash"' in g and '"new\\x0aline"' in g
    assert g.startswith("root ::= ")


def test_response_format_shapes():
    assert from_response_format(None) is None and from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    assert from_response_format(rf) == StructuredOutputsParams(json=SCHEMA, strict=True)
    rf["json_schema"]["strict"] = False
    assert from_response_format(rf).strict is False
    assert from_response_format({"type": "regex", "regex": "a+"}) == StructuredOutputsParams(regex="a+")
    assert from_response_format({"type": "choice", "choice": ["x", "y"]}).choice == ("x", "y")
    assert from_response_format({"type": "grammar", "grammar": 'root ::= "a"'}).kind == "grammar"


@pytest.mark.parametrize(
    ("rf", "words"),
    [
        ("json", "must be an object"),
        ({"type": "xml"}, "must be one of"),
        ({"type": "json_schema"}, "needs a 'json_schema' object"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "stric": True}}, "unknown fields ['stric']"),
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}, "strict must be a boolean"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "bogus-but-ours-to-find", "oneOf": []}}}, "'oneOf'"),
        ({"type": "regex"}, "needs a 'regex' field"),
        ({"type": "regex", "regex": "a", "choice": ["a"]}, "unknown fields ['choice']"),
    ],
)
def test_response_format_errors(rf, words):
    with pytest.raises(StructuredOutputError) as e:
        from_response_format(rf)
    assert e.value.code == ERROR_CODE and words in str(e.value)
