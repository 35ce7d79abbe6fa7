"""Structured output through the engine (issue 14, phase 2), with SmolLM2-135M on the CPU: JSON
schemas, regex and choice outputs validate under batching, n > 1, forced preemption (recompute and
swap), failed steps, forks past ``max_num_seqs``, seeds, ``min_tokens`` and ``max_tokens``; the
grammar cache; invalid specs; a compiling request does not hold up the queue."""

from __future__ import annotations

import contextlib
import json
import math
import re

import jsonschema
import pytest
import torch

from qworker.engine import SamplingParams
from qworker.engine.llm import LLM
from qworker.engine.structured import DEFAULT_CACHE_BYTES, GrammarCompilerService, StructuredOutputError, StructuredOutputsParams, StructuredState

from .structured_support import chat

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
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
ITEMS = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {"type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                      "required": ["sku", "qty"]},
            "minItems": 2,
            "maxItems": 3,
        },
        "status": {"enum": ["open", "closed"]},
    },
    "required": ["items", "status"],
}
SMALL = {
    "type": "object",
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]+$"}, "n": {"type": "integer", "minimum": 1, "maximum": 9},
                   "ok": {"type": "boolean"}},
    "required": ["city", "n"],
}
REGEX = r"\d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]

PROMPTS = {
    "person": chat("Extract a JSON record: John Smith, 42, a VIP customer from Boston, zip 02110, score 7.5."),
    "items": chat("Order: three ABC, one XYZ; the order is open. Give JSON."),
    "regex": chat("Write a phone number."),
    "choice": chat("Is the review 'I love it, best purchase ever' positive, negative or neutral?"),
    "small": chat("Paris, 3 nights. JSON with city and n."),
}
PLAIN = [chat("Say hi."), chat("Name three colours."), chat("What is 2 + 2?")]


def json_spec(schema, compact=True):
    return StructuredOutputsParams(json=schema, disable_any_whitespace=compact)


def specs():
    return {
        "person": (json_spec(PERSON), PERSON),
        "items": (json_spec(ITEMS), ITEMS),
        "regex": (StructuredOutputsParams(regex=REGEX), None),
        "choice": (StructuredOutputsParams(choice=CHOICES), None),
    }


def check_output(kind, text, schema=None):
    if kind in ("person", "items", "small"):
        jsonschema.validate(json.loads(text), schema)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def constrained_params(max_tokens=80, **kw):
    return [(k, SamplingParams(max_tokens=max_tokens, temperature=kw.pop("temperature", 0), structured_outputs=spec, **kw), schema)
            for k, (spec, schema) in specs().items()]


@pytest.fixture(scope="module")
def llm(model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the shared 2-core box: more threads spin against each other
    yield LLM(str(model_dir), device="cpu", kv_cache_memory=64 << 20, max_num_seqs=16)
    torch.set_num_threads(threads)


PLAIN_PARAMS = SamplingParams(max_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy outputs of the constrained requests as one batch, and of the plain ones alone."""
    cons = constrained_params()
    before = llm.stats()
    outs = llm.generate([PROMPTS[k] for k, _, _ in cons], [p for _, p, _ in cons])
    compiled = llm.stats()["grammar_compilations"] - before["grammar_compilations"]
    plain = llm.generate(PLAIN, PLAIN_PARAMS)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].token_ids for o in plain], compiled


def test_mixed_batch_validates_and_leaves_unconstrained_outputs_unchanged(llm, reference):
    want_cons, alone, compiled = reference
    assert compiled == 4
    cons = constrained_params()
    before = llm.stats()
    outs = llm.generate([PROMPTS[k] for k, _, _ in cons] + PLAIN, [p for _, p, _ in cons] + [PLAIN_PARAMS] * len(PLAIN))
    for (kind, _, schema), o in zip(cons, outs):
        c = o.outputs[0]
        assert c.finish_reason == "stop", (kind, c.text)
        check_output(kind, c.text, schema)
    assert [o.outputs[0].token_ids for o in outs[len(cons):]] == alone
    assert [o.outputs[0].token_ids for o in outs[: len(cons)]] == want_cons
    st = llm.stats()
    # the same schemas again: nothing compiles, every look-up is a cache hit
    assert st["grammar_compilations"] == before["grammar_compilations"]
    assert st["grammar_cache_hits"] == before["grammar_cache_hits"] + len(cons)
    assert st["masked_rows"] > before["masked_rows"] and st["mask_seconds"] > before["mask_seconds"]


def test_default_whitespace_json_and_json_object(llm):
    outs = llm.generate([PROMPTS["small"], PROMPTS["small"]], [
        SamplingParams(max_tokens=40, temperature=0, structured_outputs=json_spec(SMALL, compact=False)),
        SamplingParams(max_tokens=40, temperature=0, structured_outputs=StructuredOutputsParams(json_object=True)),
    ])
    a, b = (o.outputs[0] for o in outs)
    if a.finish_reason == "stop":
        jsonschema.validate(json.loads(a.text), SMALL)
    if b.finish_reason == "stop":
        assert isinstance(json.loads(b.text), dict)
    assert "stop" in (a.finish_reason, b.finish_reason)


def test_n4_sampled_seeded_reproducible_and_batch_independent(llm):
    p = SamplingParams(n=4, max_tokens=80, temperature=0.9, seed=7, structured_outputs=json_spec(ITEMS))
    solo = llm.generate(PROMPTS["items"], p)[0]  # n=4, four forks of one parse state
    for c in solo.outputs:
        if c.finish_reason == "stop":
            check_output("items", c.text, ITEMS)
    assert sum(c.finish_reason == "stop" for c in solo.outputs) >= 3
    assert len({tuple(c.token_ids) for c in solo.outputs}) > 1  # each fork its own state and draws
    # seeded and constrained: the same tokens alone as next to other (unseeded) requests
    q = SamplingParams(n=2, max_tokens=40, temperature=0.8, seed=3, structured_outputs=json_spec(SMALL))
    alone = llm.generate(PROMPTS["small"], q)[0]
    batch = llm.generate([PROMPTS["small"], PROMPTS["regex"], PLAIN[0]],
                         [q, SamplingParams(max_tokens=12, temperature=1.0, structured_outputs=StructuredOutputsParams(regex=REGEX)),
                          SamplingParams(max_tokens=16, temperature=1.0)])
    assert [c.token_ids for c in batch[0].outputs] == [c.token_ids for c in alone.outputs]
    for c in alone.outputs:
        if c.finish_reason == "stop":
            check_output("small", c.text, SMALL)
    if batch[1].outputs[0].finish_reason == "stop":
        check_output("regex", batch[1].outputs[0].text)


def test_length_leaves_a_valid_prefix(llm):
    spec = json_spec(PERSON)
    o = llm.generate(PROMPTS["person"], SamplingParams(max_tokens=6, temperature=0, structured_outputs=spec))[0].outputs[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 6
    grammar = llm.engine.grammars.submit(spec).result()
    state = StructuredState.replay(grammar, o.token_ids)  # raises if any token does not fit
    assert not state.is_terminated()


def test_min_tokens_cannot_outlast_the_grammar_and_logprobs_are_masked(llm):
    p = SamplingParams(max_tokens=20, min_tokens=8, temperature=0, logprobs=20, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    c = llm.generate(PROMPTS["choice"], p)[0].outputs[0]
    assert c.finish_reason == "stop" and c.text in CHOICES
    first = c.logprobs[0]
    # the masked distribution: the few allowed first tokens carry all the mass
    assert math.isclose(sum(math.exp(v.logprob) for v in first.values() if v.logprob > -math.inf), 1.0, rel_tol=1e-3)


def test_invalid_spec_fails_before_engine_time_and_others_run(llm):
    with pytest.raises(StructuredOutputError) as err:
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}})
    assert err.value.code == "invalid_structured_output"
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(abc"))
    bad_schema = SamplingParams(max_tokens=8, structured_outputs=json_spec({"type": "object", "properties": {"a": {"type": "strin"}}}))
    good = SamplingParams(max_tokens=8, temperature=0)
    outs = llm.generate([PROMPTS["regex"], PROMPTS["person"], PLAIN[0]], [bad, bad_schema, good])
    assert outs[0].error_code == "invalid_structured_output" and "parenthesis" in outs[0].error
    assert outs[1].error_code == "invalid_structured_output" and "strin" in outs[1].error
    for o in outs[:2]:
        assert o.outputs[0].finish_reason == "abort" and o.outputs[0].token_ids == []
        assert o.metrics.first_scheduled_time is None  # never took engine time
    assert outs[2].outputs[0].finish_reason is not None and outs[2].error is None
    with pytest.raises(StructuredOutputError) as err:
        llm.engine.validate_structured(bad_schema)  # what the worker calls at admission
    assert "strin" in str(err.value)


@contextlib.contextmanager
def hooked_grammars(engine, **kw):
    """The engine's compiler swapped for one whose compile process runs tests/engine/compile_hooks
    (a spec can ask to block or never finish), restored after."""
    real = engine.grammars
    engine.grammars = GrammarCompilerService(engine.tokenizer_info, compile_target="tests.engine.compile_hooks:compile", **kw)
    try:
        yield engine.grammars
    finally:
        engine.grammars.close()
        engine.grammars = real


def test_compiling_request_waits_without_holding_up_the_queue_and_abort(llm, tmp_path):
    e = llm.engine
    gate = tmp_path / "gate"
    digits = {"type": "string", "pattern": "^[0-9]{4}$", "description": f"GATE={gate}"}
    with hooked_grammars(e, timeout_s=120):
        e.add_request("slow", PROMPTS["regex"], SamplingParams(max_tokens=12, temperature=0, structured_outputs=json_spec(digits)))
        e.add_request("gone", PROMPTS["regex"], SamplingParams(max_tokens=12, structured_outputs=StructuredOutputsParams(regex=r"[a-c]{4}")))
        e.add_request("plain", PLAIN[0], SamplingParams(max_tokens=8, temperature=0))
        done = {}
        for _ in range(40):
            done.update((r.request_id, r) for r in e.step() if r.finished)
            if "plain" in done:
                break
        assert "plain" in done and "slow" not in done
        assert e.abort("gone") is not None
        gate.touch()
        while e.has_unfinished():
            done.update((r.request_id, r) for r in e.step() if r.finished)
        text = e.tokenizer.decode(done["slow"].seqs[0].output_token_ids, skip_special_tokens=True)
        assert re.fullmatch(r"[0-9]{4}", json.loads(text))
        assert e.stats()["num_compiling"] == 0


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_forced_preemption_n2_and_forks_past_max_num_seqs(model_dir, swap):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        block = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2: layers * (k,v) * block * kv heads * head dim * fp32
        # 9 blocks of 16: one "items" choice fits (~115 tokens), its two forks do not; the
        # regex request's forks past max_num_seqs=3 wait as well
        small = LLM(str(model_dir), device="cpu", kv_cache_memory=9 * block, max_num_seqs=3, swap_space=(16 << 20) if swap else 0)
        cons = [c for c in constrained_params(max_tokens=90, n=2) if c[0] in ("items", "regex")]
        outs = small.generate([PROMPTS[k] for k, _, _ in cons], [p for _, p, _ in cons])
        st = small.stats()
        assert st["preemptions_swap" if swap else "preemptions_recompute"] > 0, st
        for (kind, _, schema), o in zip(cons, outs):
            for c in o.outputs:
                assert c.finish_reason == "stop", (kind, c.text)
                check_output(kind, c.text, schema)
    finally:
        torch.set_num_threads(threads)


def test_failed_step_recompute_keeps_state_in_step_with_tokens(llm, reference):
    e = llm.engine
    cons = constrained_params()
    want = reference[0]
    real = e.runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] in (5, 12):  # mid-decode, twice
            raise RuntimeError("CUDA out of memory (injected)")
        return real(batch)

    e.runner.execute = flaky
    try:
        outs = llm.generate([PROMPTS[k] for k, _, _ in cons], [p for _, p, _ in cons])
    finally:
        e.runner.execute = real
    assert e.stats()["steps_failed"] >= 2
    assert [o.outputs[0].token_ids for o in outs] == want
    for (kind, _, schema), o in zip(cons, outs):
        assert o.error is None
        check_output(kind, o.outputs[0].text, schema)


def test_compile_past_the_timeout_fails_the_request_only(llm):
    e = llm.engine
    with hooked_grammars(e, timeout_s=0.5):
        outs = llm.generate([PROMPTS["regex"], PLAIN[0]], [
            SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex=r"[x-z]{3}|STUCK")), SamplingParams(max_tokens=4, temperature=0)])
        assert e.stats()["grammar_compile_timeouts"] == 1 and e.stats()["grammar_compile_processes_killed"] == 1
    assert outs[0].error_code == "invalid_structured_output" and "did not finish within 0.5 s" in outs[0].error
    assert outs[0].metrics.first_scheduled_time is None
    assert outs[1].error is None and outs[1].outputs[0].token_ids


def test_engine_bounds_its_grammar_cache_in_bytes_by_default(llm):
    """The engine passes its byte bound to the compiler (before: only an entry count, 128 entries
    of up to ~140 MB each)."""
    e = llm.engine
    assert e.config.grammar_cache_bytes == DEFAULT_CACHE_BYTES == 256 << 20
    assert e.grammars.cache_max_bytes == e.config.grammar_cache_bytes


def test_self_referential_schema_is_the_jobs_fault_not_the_engines(llm):
    """{"$ref": "#"} compiles in xgrammar to a grammar with no finite output; it used to reach the
    sampler with nothing allowed and fail as an engine error (retryable: retried forever)."""
    outs = llm.generate([PROMPTS["small"], PLAIN[0]], [SamplingParams(max_tokens=8, structured_outputs=json_spec({"$ref": "#"})),
                                                       SamplingParams(max_tokens=4, temperature=0)])
    assert outs[0].error_code == "invalid_structured_output" and "admits no finite output" in outs[0].error, outs[0].error
    assert outs[0].metrics.first_scheduled_time is None
    assert outs[1].error is None and outs[1].outputs[0].token_ids
    for ref in ("https://example.com/s.json", "file:///etc/passwd"):
        with pytest.raises(StructuredOutputError, match="only local references"):
            SamplingParams(max_tokens=8, structured_outputs=json_spec({"type": "object", "properties": {"a": {"$ref": ref}}}))
