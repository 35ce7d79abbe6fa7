"""AsyncEngine with structured output: the engine thread sleeps while every request waits for a
grammar (it used to step every few milliseconds, a core at 100%), ``validate_structured`` awaits
the compile instead of polling it, and a cheap spec queued behind compiles that never finish is
compiled once they are killed and completes constrained."""

from __future__ import annotations

import asyncio
import json
import time

import jsonschema
import pytest
import torch

from qworker.engine import AsyncEngine, SamplingParams
from qworker.engine.llm import LLM
from qworker.engine.structured import GrammarCompilerService, StructuredOutputError, StructuredOutputsParams

from .structured_support import chat

HOOKS = "tests.engine.compile_hooks:compile"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}


@pytest.fixture(scope="module")
def llm(model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(model_dir), device="cpu", kv_cache_memory=32 << 20, max_num_seqs=8)
    torch.set_num_threads(threads)


async def _started(llm, **grammar_kw) -> AsyncEngine:
    """An AsyncEngine over the module's engine, its compiler running the test hooks."""
    llm.engine.grammars = GrammarCompilerService(llm.engine.tokenizer_info, compile_target=HOOKS, **grammar_kw)
    eng = AsyncEngine(llm.engine)
    await eng.start()
    return eng


async def _stop(eng: AsyncEngine) -> None:
    await eng.shutdown()
    eng.engine.grammars.close()


async def _collect(eng, rid, prompt, params):
    """(the last delta, the whole text of choice 0)."""
    out, text = None, ""
    async for out in eng.generate(rid, prompt, params, structured_validated=True):
        text += "".join(c.text for c in out.outputs if c.index == 0)
    return out, text


async def test_engine_thread_sleeps_while_every_request_waits_for_its_grammar(llm, tmp_path):
    gate = tmp_path / "gate"
    eng = await _started(llm, timeout_s=120)
    calls = {"n": 0}
    real = eng.engine.step

    def counted():
        calls["n"] += 1
        return real()

    eng.engine.step = counted
    try:
        spec = StructuredOutputsParams(json={**SCHEMA, "description": f"GATE={gate}"})
        task = asyncio.create_task(_collect(eng, "held", chat("JSON with n."), SamplingParams(max_tokens=16, temperature=0, structured_outputs=spec)))
        while not eng.engine.grammars.stats()["grammar_compiles_running"]:
            await asyncio.sleep(0.05)
        before = calls["n"]
        await asyncio.sleep(2.0)
        # a sleeping loop wakes at most every 0.5 s; the polling loop stepped every ~5 ms
        assert calls["n"] - before <= 8, calls["n"] - before
        gate.touch()
        out, text = await asyncio.wait_for(task, 120)
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    finally:
        eng.engine.step = real
        await _stop(eng)


async def test_cheap_spec_behind_compiles_that_never_finish_completes_constrained(llm):
    """Ten schemas that never compile, then a cheap one, two compile processes and a 1 s budget:
    the ten fail alone (each killed at its budget, timed from its own start), the cheap one
    waited five budgets in the queue and still completes constrained. Before, its budget ran from
    submission and it failed with them."""
    eng = await _started(llm, timeout_s=1.0, max_workers=2)
    try:
        stuck = [SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json={"type": "object", "description": f"STUCK {i}"}))
                 for i in range(10)]
        cheap = SamplingParams(max_tokens=16, temperature=0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
        t0 = time.monotonic()
        results = await asyncio.gather(*(eng.validate_structured(p) for p in [*stuck, cheap]), return_exceptions=True)
        waited = time.monotonic() - t0
        for r in results[:-1]:
            assert isinstance(r, StructuredOutputError) and "did not finish within 1 s" in str(r), r
        assert results[-1] is None, results[-1]
        assert waited > 1.0  # it really queued behind them (a lower bound: no machine is too fast)
        st = eng.engine.grammars.stats()
        assert st["grammar_compile_timeouts"] == 10 and st["grammar_compile_processes_killed"] == 10
        out, text = await asyncio.wait_for(_collect(eng, "cheap", chat("JSON with n."), cheap), 120)
        assert out.error is None and out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    finally:
        await _stop(eng)
