"""SmolLM2-135M under the structured mask: one batched greedy HF decode (phase 1 runs without the
engine) mixing a nested JSON schema, a regex, a choice and an unconstrained row."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from qworker.engine.structured import GrammarCompilerService, StructuredBitmask, StructuredOutputsParams, StructuredState

from .structured_support import chat, generate, model, model_config, tokenizer_info

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["customer", "vip", "new"]}, "minItems": 1, "maxItems": 2},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]+$"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
        "email": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "age", "tags", "address"],
}
REGEX = r"\d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def run():
    torch.manual_seed(0)
    svc = GrammarCompilerService(tokenizer_info())
    specs = [
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(choice=CHOICES),
    ]
    handles = [svc.submit(s) for s in specs]  # compile off-thread while the model loads
    prompts = [
        chat("Extract a JSON record: John Smith, 42 years old, a VIP customer from Boston, zip 02110."),
        chat("Write a phone number."),
        chat("Is the review 'I love it, best purchase ever' positive, negative or neutral?"),
        chat("Say hi."),
    ]
    model()
    for h in handles:
        h.wait()
    states = [StructuredState(h.result()) for h in handles] + [None]
    bm = StructuredBitmask(model_config().vocab_size)
    gens = generate(prompts, states, max_new_tokens=64, bitmask=bm)
    return gens, states, bm


def test_json_schema_output_validates(run):
    gens, states, _ = run
    g = gens[0]
    assert g.finish_reason == "stop", g.text
    jsonschema.validate(json.loads(g.text), SCHEMA)
    assert states[0].is_terminated()


def test_regex_output_fullmatches(run):
    g = run[0][1]
    assert g.finish_reason == "stop" and re.fullmatch(REGEX, g.text), g.text


def test_choice_output_is_a_choice(run):
    g = run[0][2]
    assert g.finish_reason == "stop" and g.text in CHOICES, g.text


def test_unconstrained_neighbour_runs_free_and_mask_time_is_counted(run):
    gens, _, bm = run
    assert gens[3].text and gens[3].text[0] != "{"
    assert bm.mask_steps >= len(gens[0].token_ids) and bm.mask_seconds > 0
    assert bm.masked_rows >= len(gens[0].token_ids) + len(gens[1].token_ids) + len(gens[2].token_ids)
