"""Structured output through Kafka (issue 14): the real worker, engine (SmolLM2) and broker. A job
with a json_schema ``response_format`` gets a completion whose text validates; a bad schema and a
bad regex get ``invalid_structured_output`` (not retryable) before taking engine time; a plain
job in the same poll still completes and the worker keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import jsonschema
import pytest

from qworker.messages import Job, Sampling
from qworker.worker import Worker
from qworker.worker.client import submit

from .conftest import Results, wait_committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
        "nights": {"type": "integer", "minimum": 1, "maximum": 30},
        "breakfast": {"type": "boolean"},
    },
    "required": ["city", "nights"],
}


def job(jid: str, rf: dict | None, **kw) -> Job:
    return Job(id=jid, messages=[{"role": "user", "content": "Book Paris for 3 nights with breakfast. Reply in JSON."}],
               sampling=Sampling(max_tokens=48, temperature=0.0), response_format=rf, **kw)


@contextlib.contextmanager
def hooked_grammars(eng, **kw):
    """The engine's compiler swapped for one whose compile processes run tests/engine/compile_hooks
    (a spec can ask to block or never finish), restored after."""
    from qworker.engine.structured import GrammarCompilerService

    real = eng.engine.grammars
    eng.engine.grammars = GrammarCompilerService(eng.engine.tokenizer_info, compile_target="tests.engine.compile_hooks:compile", **kw)
    eng.engine.grammars.add_listener(eng._wake.set)
    try:
        yield eng.engine.grammars
    finally:
        eng.engine.grammars.close()
        eng.engine.grammars = real


async def test_json_schema_job_validates_bad_specs_get_invalid_structured_output(real_engine, topics, results: Results, tmp_path) -> None:
    eng, _ = real_engine
    w = Worker(topics, eng)
    await w.start()
    try:
        rf = {"type": "json_schema", "json_schema": {"name": "booking", "schema": SCHEMA, "strict": True}}
        bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}
        bad_regex = {"type": "regex", "regex": "(unclosed"}
        unsupported = {"type": "json_schema", "json_schema": {"name": "y", "schema": {"oneOf": [{"type": "string"}]}}}
        steps_before = eng.engine.counters["steps"]
        await submit(topics, [job("bad-schema", bad_schema), job("bad-regex", bad_regex), job("unsupported", unsupported)])
        await results.wait(lambda: len(results.completions) == 3, 60)
        assert eng.engine.counters["steps"] == steps_before, "a bad spec took engine time"
        await submit(topics, [job("json", rf, stream=True), job("plain", None), job("choice", {"type": "choice", "choice": ["yes", "no"]})])
        await results.wait(lambda: len(results.completions) == 6, 90)
        for jid, needle in (("bad-schema", "strin"), ("bad-regex", "parenthesis"), ("unsupported", "oneOf")):
            [e] = results.completions[jid]
            assert e["type"] == "error" and e["error"]["code"] == "invalid_structured_output" and not e["error"]["retryable"], e
            assert needle in e["error"]["message"], e
        [c] = results.completions["json"]
        assert c["type"] == "completion", c
        ch = c["choices"][0]
        assert ch["finish_reason"] == "stop", ch
        jsonschema.validate(json.loads(ch["text"]), SCHEMA)
        assert results.completions["plain"][0]["type"] == "completion"
        assert results.completions["choice"][0]["choices"][0]["text"] in ("yes", "no")
        # the worker keeps serving, and a repeated schema is a cache hit, not a compile
        compiled = eng.engine.stats()["grammar_compilations"]
        await submit(topics, [job("json-again", rf)])
        await results.wait(lambda: "json-again" in results.completions, 60)
        again = results.completions["json-again"][0]
        assert again["type"] == "completion" and again["choices"][0]["text"] == ch["text"]
        assert eng.engine.stats()["grammar_compilations"] == compiled
        # a slow compile holds up nobody: a plain job submitted after it completes first
        with hooked_grammars(eng, timeout_s=120) as grammars:
            gate = tmp_path / "gate"
            slow_schema = {"type": "string", "pattern": "^[0-9]{2}$", "description": f"GATE={gate}"}
            await submit(topics, [job("slow", {"type": "json_schema", "json_schema": {"name": "d", "schema": slow_schema}})])
            while not grammars.stats()["grammar_compiles_running"]:
                await asyncio.sleep(0.05)
            await submit(topics, [Job(id="quick", prompt="Hello", sampling=Sampling(max_tokens=2, temperature=0.0))])
            await results.wait(lambda: "quick" in results.completions, 60)
            assert "slow" not in results.completions
            gate.touch()
            await results.wait(lambda: "slow" in results.completions, 60)
        assert results.completions["quick"][0]["type"] == "completion"
        assert re.fullmatch("[0-9]{2}", json.loads(results.completions["slow"][0]["choices"][0]["text"]))
        await wait_committed(topics)
    finally:
        await w.stop()


def test_sampling_options_reach_the_engine() -> None:
    from qworker.engine import SamplingParams

    p = SamplingParams(**Sampling(include_stop_str_in_output=True, stop=["."]).engine_kwargs())
    assert p.include_stop_str_in_output is True and p.stop == ["."]


async def test_cheap_job_behind_ten_slow_schemas_completes_constrained(real_engine, topics, results: Results) -> None:
    """Ten schemas whose compile never finishes, then a cheap one: each slow one is killed at its
    budget (timed from its own start) and answered alone; the cheap job completes constrained.
    Before, the budget ran from submission: the cheap job got invalid_structured_output too, and
    the timed-out compiles kept running. A self-referential schema and an external $ref are the
    job's fault: invalid_structured_output, not retryable (the first used to be a retryable
    engine_error, the second silently unconstrained)."""
    eng, _ = real_engine
    w = Worker(topics, eng)
    await w.start()
    try:
        with hooked_grammars(eng, timeout_s=1.0, max_workers=2) as grammars:
            slow = [job(f"slow-{i}", {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "description": f"STUCK {i}"}}})
                    for i in range(10)]
            cheap = job("cheap", {"type": "json_schema", "json_schema": {"name": "booking", "schema": SCHEMA}})
            self_ref = job("self-ref", {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#"}}})
            external = job("external", {"type": "json_schema", "json_schema": {"name": "e", "schema": {
                "type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}}})
            await submit(topics, [*slow, cheap, self_ref, external])
            await results.wait(lambda: len(results.completions) == 13, 150)
            assert grammars.stats()["grammar_compile_processes_killed"] == 10
        for i in range(10):
            [e] = results.completions[f"slow-{i}"]
            assert e["type"] == "error" and e["error"]["code"] == "invalid_structured_output" and not e["error"]["retryable"], e
            assert "did not finish within 1 s" in e["error"]["message"], e
        [c] = results.completions["cheap"]
        assert c["type"] == "completion", c
        assert c["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["choices"][0]["text"]), SCHEMA)
        for jid, needle in (("self-ref", "admits no finite output"), ("external", "only local references")):
            [e] = results.completions[jid]
            assert e["type"] == "error" and e["error"]["code"] == "invalid_structured_output" and not e["error"]["retryable"], e
            assert needle in e["error"]["message"], e
        await wait_committed(topics)
    finally:
        await w.stop()


def test_grammar_cache_bytes_setting_reaches_the_engine() -> None:
    """QWORKER_GRAMMAR_CACHE_BYTES (a size with a unit, like the other memory settings) becomes the
    engine's grammar_cache_bytes; unset, the engine's default byte bound applies (256 MiB)."""
    from pydantic import ValidationError

    from qworker.config import WorkerSettings
    from qworker.engine.config import EngineConfig

    cfg = WorkerSettings.from_env({"QWORKER_GRAMMAR_CACHE_BYTES": "64MiB"}).engine_config()
    assert cfg["grammar_cache_bytes"] == 64 << 20
    assert EngineConfig(model="m", **cfg).grammar_cache_bytes == 64 << 20
    assert "grammar_cache_bytes" not in WorkerSettings.from_env({}).engine_config()
    assert EngineConfig(model="m").grammar_cache_bytes == 256 << 20
    with pytest.raises(ValidationError):
        WorkerSettings.from_env({"QWORKER_GRAMMAR_CACHE_BYTES": "-1"})
