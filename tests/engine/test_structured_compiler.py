"""The grammar compiler service: compiles in child processes, the byte-bounded LRU cache and its
counters, single flight, the compiler's own error messages, and the budget that kills a compile
without failing anyone else."""

from __future__ import annotations

import gc
import os
import time

import pytest
import xgrammar as xgr

from qworker.engine.structured import DEFAULT_CACHE_BYTES, ERROR_CODE, GrammarCompilerService, StructuredOutputError, StructuredOutputsParams, compiler_message

from .structured_support import tokenizer_info

HOOKS = "tests.engine.compile_hooks:compile"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}


@pytest.fixture(scope="module")
def ti():
    return tokenizer_info()


@pytest.fixture(scope="module")
def shared(ti):
    """One service (one compile process) for the tests that only read counter deltas."""
    svc = GrammarCompilerService(ti, max_workers=1)
    yield svc
    svc.close()


def _wait(handle, limit=120.0):
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
    a, b = StructuredOutputsParams(regex="a+"), StructuredOutputsParams(regex="b+")
    size_a = GrammarCompilerService(ti).validate(a).memory_size_bytes
    svc = GrammarCompilerService(ti, cache_max_bytes=size_a + 1, max_workers=1)
    svc.validate(a)
    svc.validate(b)  # over the byte bound: the older entry goes
    assert svc.cached(b.key) and not svc.cached(a.key)
    assert svc.stats()["grammar_cache_bytes"] == svc.validate(b).memory_size_bytes
    tiny = GrammarCompilerService(ti, cache_max_bytes=1, max_workers=1)
    assert tiny.validate(a) is not None  # larger than the whole bound: served, never cached
    assert tiny.stats()["grammar_cache_size"] == 0 and tiny.stats()["grammar_cache_bytes"] == 0


def test_identical_specs_in_flight_share_one_compile(ti, tmp_path):
    gate = tmp_path / "gate"
    svc = GrammarCompilerService(ti, timeout_s=60, compile_target=HOOKS)
    spec = f"a+|GATE={gate}"
    a = svc.submit(StructuredOutputsParams(regex=spec))
    b = svc.submit(StructuredOutputsParams(regex=spec))
    assert not a.done and not b.done
    gate.touch()
    assert _wait(a, 120).result() is _wait(b, 120).result()
    st = svc.stats()
    assert st["grammar_compilations"] == 1 and st["grammar_cache_hits"] == 1


def test_lru_cache_is_bounded(ti):
    svc = GrammarCompilerService(ti, cache_size=2)
    r = [StructuredOutputsParams(regex=f"a{{{i}}}") for i in range(1, 4)]
    svc.validate(r[0])
    svc.validate(r[1])
    svc.validate(r[0])  # r[0] is now the most recent
    svc.validate(r[2])  # evicts r[1]
    assert svc.cached(r[0].key) and svc.cached(r[2].key) and not svc.cached(r[1].key)
    assert svc.stats()["grammar_cache_size"] == 2
    svc.validate(r[1])  # this spec object still holds its grammar: no compile
    assert svc.stats()["grammar_compilations"] == 3
    svc.validate(StructuredOutputsParams(regex="a{2}"))  # a new request with it: evicted, compiled again
    assert svc.stats()["grammar_compilations"] == 4


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutputsParams(json={"type": "nonsense"}), 'invalid json: Unsupported type "nonsense"'),
        (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
        # a $ref to nothing is refused before any compile: tests/engine/test_structured_review_regressions.py
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
def test_invalid_input_fails_with_the_compilers_message(shared, spec, words):
    svc = shared
    before = svc.stats()
    h = _wait(svc.submit(spec))
    assert h.done and not h.ready
    assert isinstance(h.error, StructuredOutputError) and h.error.code == ERROR_CODE
    assert words in str(h.error)
    assert ".cc:" not in str(h.error)  # the C++ log prefix is stripped
    with pytest.raises(StructuredOutputError, match="invalid"):
        svc.validate(spec)  # the error is cached: no second compile
    st = svc.stats()
    assert tuple(st[k] - before[k] for k in ("grammar_compilations", "grammar_compile_failures", "grammar_cache_hits")) == (1, 1, 1)


def test_compiler_message_strips_the_log_prefix():
    e = RuntimeError("[06:10:40] /project/cpp/json_schema_converter.cc:4939: Check failed: (error.empty()) is false: Failed to parse JSON")
    assert compiler_message(e) == "Failed to parse JSON"


def _pids(svc) -> set[int]:
    return {c.pid for c in svc._pool._children}


def _gone(pid: int) -> bool:
    """The process exits (SIGKILL) and is reaped; a guard, not a timing: it never comes back."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


def test_budget_counts_from_the_compile_start_and_a_timed_out_compile_is_killed(ti):
    """Three compiles that never finish, then a cheap one, on one compile process: each stuck one
    is killed at its budget and fails alone; the cheap one waited three budgets in the queue and
    still compiles (before: its budget ran from submission, so it failed too, and the stuck
    compiles kept running on their threads)."""
    svc = GrammarCompilerService(ti, timeout_s=1.0, max_workers=1, compile_target=HOOKS)
    stuck = [svc.submit(StructuredOutputsParams(json={"type": "object", "description": f"STUCK {i}"})) for i in range(3)]
    cheap = svc.submit(StructuredOutputsParams(json=SCHEMA))
    while not svc.stats()["grammar_compiles_running"]:
        time.sleep(0.01)
    first_child = _pids(svc)
    for h in stuck:
        assert isinstance(_wait(h, 120).error, StructuredOutputError) and "did not finish within 1 s" in str(h.error)
    assert _wait(cheap, 120).ready, cheap.error
    assert xgr.GrammarMatcher(cheap.result()).accept_string('{"n": 3}')
    st = svc.stats()
    assert st["grammar_compile_timeouts"] == 3 and st["grammar_compile_processes_killed"] == 3
    assert all(_gone(pid) for pid in first_child)  # the stuck compile stopped using a core
    assert not svc.cached(stuck[0].key)  # a timeout is not the spec's verdict: not cached
    again = svc.submit(StructuredOutputsParams(json={"type": "object", "description": "STUCK 0"}))
    assert not again.done  # compiled again (and killed again), not answered from a cache


def test_a_crashing_compile_fails_its_job_only(ti):
    svc = GrammarCompilerService(ti, timeout_s=60, max_workers=1, compile_target=HOOKS)
    crash = svc.submit(StructuredOutputsParams(regex="CRASH"))
    fine = svc.submit(StructuredOutputsParams(regex="[0-9]+"))
    assert isinstance(_wait(crash, 120).error, StructuredOutputError) and "crashed" in str(crash.error)
    assert _wait(fine, 120).ready
    assert svc.stats()["grammar_compile_crashes"] == 1


def test_a_queued_compile_nobody_waits_for_is_never_started(ti, tmp_path):
    gate = tmp_path / "gate"
    svc = GrammarCompilerService(ti, timeout_s=60, max_workers=1, compile_target=HOOKS)
    busy = svc.submit(StructuredOutputsParams(regex=f"x|GATE={gate}"))
    queued = svc.submit(StructuredOutputsParams(regex="queued"))
    key = queued.key
    del queued  # the request holding it was aborted
    gc.collect()
    gate.touch()
    assert _wait(busy, 120).ready
    while svc.stats()["grammar_compiles_in_flight"]:
        time.sleep(0.01)
    assert svc.stats()["grammar_compilations"] == 1 and not svc.cached(key)


def test_burst_larger_than_the_cache_compiles_each_schema_once(ti):
    """The worker validates a job's spec at admission and the engine submits the same spec object
    later; a burst of distinct schemas larger than the cache evicts each between the two. The
    spec keeps its grammar: six schemas, six compiles (before: twelve)."""
    svc = GrammarCompilerService(ti, cache_size=2)
    specs = [StructuredOutputsParams(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}) for i in range(6)]
    handles = [svc.submit(s) for s in specs]  # admission: all in flight at once
    for h in handles:
        _wait(h, 120)
    engine_side = [svc.submit(s, admitted=True) for s in specs]
    assert all(h.done and h.ready for h in engine_side)
    assert [h.result() for h in engine_side] == [h.result() for h in handles]
    st = svc.stats()
    assert st["grammar_compilations"] == 6 and st["grammar_cache_size"] == 2, st


def test_grammar_memory_stays_under_the_byte_bound_under_a_burst_of_large_schemas(ti):
    """Distinct large schemas (~1.3 MB of compiled grammar each) against a 2.5 MB bound: the cache's
    own accounting of xgrammar's memory_size_bytes never exceeds it. By default the bound is
    DEFAULT_CACHE_BYTES (before: no byte bound unless a caller passed one; the engine did not)."""
    assert GrammarCompilerService(ti).cache_max_bytes == DEFAULT_CACHE_BYTES
    bound = 5 << 19  # 2.5 MiB: about two of them
    svc = GrammarCompilerService(ti, cache_max_bytes=bound)
    sizes, peak = [], 0
    for i in range(5):
        g = svc.validate(StructuredOutputsParams(json={"type": "string", "minLength": 30, "maxLength": 40 + i}))
        sizes.append(g.memory_size_bytes)
        peak = max(peak, svc.stats()["grammar_cache_bytes"])
    assert min(sizes) > bound // 4, sizes  # large enough that the burst overflows the bound
    assert sum(sizes) > 2 * bound
    assert peak <= bound, (peak, bound)


def test_self_referential_and_external_refs_are_refused_with_a_reason(ti):
    svc = GrammarCompilerService(ti, max_workers=1)
    for schema in ({"$ref": "#"}, {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
                   {"type": "array", "items": {"$ref": "#"}, "minItems": 1}):
        with pytest.raises(StructuredOutputError, match="admits no finite output") as e:
            svc.validate(StructuredOutputsParams(json=schema))
        assert e.value.code == ERROR_CODE
    # a recursion with a way out is fine
    g = svc.validate(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#"}}}))
    assert xgr.GrammarMatcher(g).accept_string('{"a": {}}')
    with pytest.raises(StructuredOutputError, match="admits no finite output"):
        svc.validate(StructuredOutputsParams(grammar='root ::= "a" root'))
    for ref in ("https://example.com/schema.json", "file:///etc/passwd", "other.json#/x"):
        with pytest.raises(StructuredOutputError, match="only local references"):
            StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": ref}}})


def test_a_character_class_that_matches_nothing_is_refused(ti):
    """``[^\\s\\S]`` (or ``[^\\x00-\\U0010FFFF]``) compiles, matches no character, and its job
    ended with a bare abort at its first token, retried by the worker forever (helper-62): now
    the compile refuses it like any empty language; classes with something left are fine."""
    svc = GrammarCompilerService(ti, max_workers=1)
    for spec in ({"regex": r"[^\s\S]"}, {"regex": r"a[^\s\S]"}, {"grammar": 'root ::= "x" [^\\x00-\\U0010FFFF]'},
                 {"json": {"type": "object", "properties": {"q": {"type": "string", "pattern": r"^[^\s\S]$"}}, "required": ["q"]}}):
        with pytest.raises(StructuredOutputError, match="admits no finite output") as e:
            svc.validate(StructuredOutputsParams(**spec))
        assert e.value.code == ERROR_CODE
    for spec in ({"regex": r"[^\s]"}, {"regex": r"[^\x00-\U0010FFFE]"}, {"regex": "[a]"}):
        svc.validate(StructuredOutputsParams(**spec))


def test_concurrent_real_compiles(ti):
    svc = GrammarCompilerService(ti, max_workers=2)
    specs = [StructuredOutputsParams(json={"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}) for i in range(6)]
    handles = [svc.submit(s) for s in specs]
    for i, h in enumerate(handles):
        m = xgr.GrammarMatcher(_wait(h).result())
        assert m.accept_string(f'{{"k{i}": 7}}') and m.is_completed()
    assert svc.stats()["grammar_compilations"] == 6
