"""The grammar compiler service: off-thread compiles, the LRU cache and its counters, the
compiler's own error messages, and the timeout that fails a request without blocking anyone."""

from __future__ import annotations

import threading
import time

import pytest
import xgrammar as xgr

from qworker.engine.structured import ERROR_CODE, GrammarCompilerService, StructuredOutputError, StructuredOutputsParams, compiler_message

from .structured_support import tokenizer_info

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}


@pytest.fixture(scope="module")
def ti():
    return tokenizer_info()


def _wait(handle, limit=10.0):
    end = time.monotonic() + limit
    while not handle.done:  # what the scheduler does each step: poll, never block
        assert time.monotonic() < end, "the compile never finished"
        time.sleep(0.002)
    return handle


def test_compiles_every_kind_off_thread(ti):
    svc = GrammarCompilerService(ti)
    specs = [
        StructuredOutputsParams(json=SCHEMA),
        StructuredOutputsParams(json_object=True),
        StructuredOutputsParams(regex=r"[a-c]{2}\d"),
        StructuredOutputsParams(choice=["yes", "no"]),
        StructuredOutputsParams(grammar='root ::= "x" ("," "x")*'),
    ]
    handles = [svc.submit(s) for s in specs]
    for h in handles:
        _wait(h)
        assert h.ready and h.error is None
        assert isinstance(h.result(), xgr.CompiledGrammar)
    st = svc.stats()
    assert st["grammar_compilations"] == 5 and st["grammar_cache_hits"] == 0 and st["grammar_compile_seconds"] > 0


def test_second_compile_of_the_same_schema_is_a_cache_hit(ti):
    svc = GrammarCompilerService(ti)
    g1 = svc.validate(StructuredOutputsParams(json=SCHEMA))
    reordered = {"required": ["n"], "type": "object", "properties": {"n": {"maximum": 9, "minimum": 0, "type": "integer"}}}
    h = svc.submit(StructuredOutputsParams(json=reordered))
    assert h.done and h.ready  # ready at once: no thread, no wait
    assert h.result() is g1
    st = svc.stats()
    assert (st["grammar_compilations"], st["grammar_cache_hits"]) == (1, 1)


def test_admission_validate_then_engine_submit_counts_one_lookup(ti):
    svc = GrammarCompilerService(ti)
    for _ in range(2):  # two jobs with one schema: the worker validates, the engine submits
        spec = StructuredOutputsParams(json=SCHEMA)
        svc.validate(spec)
        assert svc.submit(spec, admitted=True).ready
    st = svc.stats()
    assert (st["grammar_compilations"], st["grammar_cache_hits"]) == (1, 1)


def test_cache_byte_bound(ti):
    svc = GrammarCompilerService(ti, cache_max_bytes=1)
    a, b = StructuredOutputsParams(regex="a+"), StructuredOutputsParams(regex="b+")
    svc.validate(a)
    svc.validate(b)  # over the byte bound: the older entry goes, the newest always stays
    assert svc.cached(b.key) and not svc.cached(a.key)
    assert svc.stats()["grammar_cache_bytes"] == svc.validate(b).memory_size_bytes


def test_identical_specs_in_flight_share_one_compile():
    gate = threading.Event()
    calls = []

    def slow(spec):
        calls.append(spec.key)
        gate.wait(5)
        return "compiled"

    svc = GrammarCompilerService(compile_fn=slow, timeout_s=5)
    a = svc.submit(StructuredOutputsParams(regex="a+"))
    b = svc.submit(StructuredOutputsParams(regex="a+"))
    assert not a.done and not b.done
    gate.set()
    assert _wait(a).result() == "compiled" == _wait(b).result()
    assert len(calls) == 1 and svc.stats()["grammar_cache_hits"] == 1


def test_lru_cache_is_bounded(ti):
    svc = GrammarCompilerService(ti, cache_size=2)
    r = [StructuredOutputsParams(regex=f"a{{{i}}}") for i in range(1, 4)]
    svc.validate(r[0])
    svc.validate(r[1])
    svc.validate(r[0])  # r[0] is now the most recent
    svc.validate(r[2])  # evicts r[1]
    assert svc.cached(r[0].key) and svc.cached(r[2].key) and not svc.cached(r[1].key)
    assert svc.stats()["grammar_cache_size"] == 2
    svc.validate(r[1])
    assert svc.stats()["grammar_compilations"] == 4


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutputsParams(json={"type": "nonsense"}), 'invalid json: Unsupported type "nonsense"'),
        (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
        (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}), "Cannot find field $defs"),
        (StructuredOutputsParams(json={"type": "string", "pattern": "(ab"}), "parenthesis is not closed"),
        (StructuredOutputsParams(regex="(abc"), "invalid regex: Regex parsing error at position 5: The parenthesis is not closed."),
        (StructuredOutputsParams(regex="a{3,1}"), "Lower bound is larger than upper bound"),
        (StructuredOutputsParams(regex="(?=a)a"), "Lookahead is not supported yet"),
        (StructuredOutputsParams(regex=r"\bword\b"), "Word boundary is not supported yet"),
        (StructuredOutputsParams(grammar='root ::= "a" | '), "invalid grammar: EBNF parser error at line 1"),
        (StructuredOutputsParams(grammar="root ::= undefined_rule"), 'Rule "undefined_rule" is not defined'),
        (StructuredOutputsParams(grammar='start ::= "a"'), 'The root rule with name "root" is not found'),
    ],
)
def test_invalid_input_fails_with_the_compilers_message(ti, spec, words):
    svc = GrammarCompilerService(ti)
    h = _wait(svc.submit(spec))
    assert h.done and not h.ready
    assert isinstance(h.error, StructuredOutputError) and h.error.code == ERROR_CODE
    assert words in str(h.error)
    assert ".cc:" not in str(h.error)  # the C++ log prefix is stripped
    with pytest.raises(StructuredOutputError, match="invalid"):
        svc.validate(spec)  # the error is cached: no second compile
    st = svc.stats()
    assert (st["grammar_compilations"], st["grammar_compile_failures"], st["grammar_cache_hits"]) == (1, 1, 1)


def test_compiler_message_strips_the_log_prefix():
    e = RuntimeError("[06:10:40] /project/cpp/json_schema_converter.cc:4939: Check failed: (error.empty()) is false: Failed to parse JSON")
    assert compiler_message(e) == "Failed to parse JSON"


def test_timeout_fails_the_request_and_frees_the_slot():
    gate = threading.Event()
    started = []

    def compile_fn(spec):
        started.append(spec.regex)
        if spec.regex == "slow":
            gate.wait(10)  # a grammar that takes "forever"; xgrammar cannot be interrupted
        return f"compiled {spec.regex}"

    svc = GrammarCompilerService(compile_fn=compile_fn, timeout_s=0.2, max_workers=1, max_background=1)
    slow = svc.submit(StructuredOutputsParams(regex="slow"))
    fast = svc.submit(StructuredOutputsParams(regex="fast"), timeout_s=5)
    t0 = time.monotonic()
    assert not slow.done and not fast.done  # non-blocking submit; fast waits for the one slot
    assert svc.stats()["grammar_compiles_queued"] == 1
    _wait(slow)
    waited = time.monotonic() - t0
    assert 0.15 <= waited < 2.0
    assert slow.error is not None and slow.error.code == ERROR_CODE and "did not finish within 0.2 s" in str(slow.error)
    with pytest.raises(StructuredOutputError, match="did not finish"):
        slow.result()
    # the slow compile is still running, but it gave its slot back: the fast one gets through
    assert _wait(fast).result() == "compiled fast"
    st = svc.stats()
    assert st["grammar_compile_timeouts"] == 1 and st["grammar_compiles_background"] == 1
    gate.set()  # the background compile finishes late: its result is cached, not wasted
    end = time.monotonic() + 5
    while svc.stats()["grammar_compiles_background"]:
        assert time.monotonic() < end
        time.sleep(0.005)
    again = svc.submit(StructuredOutputsParams(regex="slow"))
    assert again.ready and again.result() == "compiled slow"
    assert started == ["slow", "fast"]


def test_background_compiles_are_bounded():
    gate = threading.Event()

    def compile_fn(spec):
        gate.wait(10)
        return spec.regex

    svc = GrammarCompilerService(compile_fn=compile_fn, timeout_s=0.05, max_workers=1, max_background=0)
    first = svc.submit(StructuredOutputsParams(regex="one"))
    _wait(first)
    assert first.error is not None
    late = svc.submit(StructuredOutputsParams(regex="two"), timeout_s=0.1)
    _wait(late)  # no background room: the stuck compile keeps its slot, "two" never starts
    assert late.error is not None and svc.stats()["grammar_compilations"] == 1
    gate.set()


def test_a_queued_compile_nobody_waits_for_is_never_started():
    gate = threading.Event()
    started = []

    def compile_fn(spec):
        started.append(spec.regex)
        gate.wait(10)
        return spec.regex

    svc = GrammarCompilerService(compile_fn=compile_fn, timeout_s=5, max_workers=1, max_background=0)
    busy = svc.submit(StructuredOutputsParams(regex="busy"))
    queued = svc.submit(StructuredOutputsParams(regex="queued"), timeout_s=0.05)
    assert not _wait(queued).ready
    gate.set()
    _wait(busy)
    time.sleep(0.05)
    assert started == ["busy"]


def test_real_slow_grammar_times_out_without_blocking(ti):
    svc = GrammarCompilerService(ti, timeout_s=0.02)
    t0 = time.monotonic()
    h = svc.submit(StructuredOutputsParams(regex="[a-z]{1,3000}"))  # about 1 s of xgrammar work
    assert time.monotonic() - t0 < 0.05  # submit returns at once
    with pytest.raises(StructuredOutputError, match="did not finish within 0.02 s"):
        svc.validate(StructuredOutputsParams(regex="[a-z]{1,3000}"))
    assert not _wait(h).ready
    assert time.monotonic() - t0 < 0.5


def test_concurrent_real_compiles(ti):
    svc = GrammarCompilerService(ti, max_workers=2)
    specs = [StructuredOutputsParams(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}) for i in range(6)]
    handles = [svc.submit(s) for s in specs]
    for i, h in enumerate(handles):
        m = xgr.GrammarMatcher(_wait(h).result())
        assert m.accept_string(f'{{"k{i}": 7}}') and m.is_completed()
    assert svc.stats()["grammar_compilations"] == 6
