"""AsyncEngine: streamed deltas, aborts, bad input that leaves the engine serving others."""

from __future__ import annotations

import asyncio
import random

import pytest

from qworker import AsyncEngine, InvalidRequestError, LLM, SamplingParams
from qworker.engine.sampling_params import MAX_N
from tests.engine.engine_support import HeldForward


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir)


async def collect(engine, rid, prompt, params, priority=0):
    deltas = []
    async for out in engine.generate(rid, prompt, params, priority):
        deltas.append(out)
    return deltas


async def test_stream_deltas_concatenate_to_offline_output(model):
    rng = random.Random()
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(2, 40))] for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, stop=["e t"])
    offline = LLM(model, kv_cache_memory=8 << 20).generate(prompts, params)
    engine = AsyncEngine.from_model(model, kv_cache_memory=8 << 20)
    await engine.start()
    try:
        results = await asyncio.gather(*(collect(engine, f"r{i}", p, params) for i, p in enumerate(prompts)))
    finally:
        await engine.shutdown()
    for deltas, off in zip(results, offline):
        assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])
        text = "".join(c.text for d in deltas for c in d.outputs)
        ids = [t for d in deltas for c in d.outputs for t in c.token_ids]
        assert ids == off.outputs[0].token_ids
        assert text == off.outputs[0].text
        assert deltas[-1].outputs[0].finish_reason == off.outputs[0].finish_reason
        assert len(deltas) > 1, "deltas are streamed, not delivered at the end"


async def test_abort_and_cancel_free_everything(model):
    engine = AsyncEngine.from_model(model, kv_cache_memory=8 << 20)
    await engine.start()
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    # one forward (the first token) and then the engine is held while the request is aborted, so
    # it cannot run to its end first on a fast machine
    held = HeldForward(engine.engine, passes=1)
    try:
        gen = engine.generate("a", [5, 6, 7], params)
        first = await gen.__anext__()
        assert not first.finished
        await engine.abort("a")
        held.free()
        rest = [d async for d in gen]
        assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"

        # cancelling the consumer task aborts the request too (while its step is held)
        held.passes = 0
        held.entered.clear()
        task = asyncio.create_task(collect(engine, "b", [9, 10, 11], params))
        while not held.entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        held.release()
        # stats() is the step thread's snapshot: wait for the one taken after both aborts
        for _ in range(600):
            st = engine.stats()
            if st["requests_aborted"] == 2 and st["num_running"] == 0 and st["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.05)
        stats = engine.stats()
        assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0 and stats["requests_aborted"] == 2
    finally:
        held.release()
        await engine.shutdown()


async def test_bad_input_clear_errors_and_others_keep_running(model):
    engine = AsyncEngine.from_model(model, kv_cache_memory=8 << 20, max_model_len=256)
    await engine.start()
    try:
        good = asyncio.create_task(collect(engine, "good", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)))
        bad_cases = {
            "empty_prompt": lambda: collect(engine, "x1", "", SamplingParams()),
            "empty ids": lambda: collect(engine, "x2", [], SamplingParams()),
            "prompt_too_long": lambda: collect(engine, "x3", [5] * 300, SamplingParams()),
            "out of vocab": lambda: collect(engine, "x4", [10**9], SamplingParams()),
        }
        for name, make in bad_cases.items():
            with pytest.raises(InvalidRequestError) as e:
                await make()
            assert e.value.code in ("empty_prompt", "prompt_too_long", "invalid_prompt"), name
        for kwargs in ({"max_tokens": 0}, {"n": MAX_N + 1}, {"temperature": -1}, {"top_p": 0}, {"logprobs": 10**6}):
            with pytest.raises(InvalidRequestError) as e:
                SamplingParams(**kwargs)
            assert e.value.code == "invalid_sampling" and str(e.value)
        with pytest.raises(TypeError):
            SamplingParams(unknown_knob=1)
        deltas = await good
        assert deltas[-1].finished and sum(len(c.token_ids) for d in deltas for c in d.outputs) == 30
        held = HeldForward(engine.engine)  # the first "dup" cannot finish before the second arrives
        try:
            with pytest.raises(ValueError):  # a duplicate in-flight id is refused
                dup = asyncio.create_task(collect(engine, "dup", [1, 2], SamplingParams(max_tokens=200, ignore_eos=True)))
                while not held.entered.is_set():  # the first is in a (held) step
                    await asyncio.sleep(0.01)
                try:
                    await collect(engine, "dup", [1, 2], SamplingParams(max_tokens=2))
                finally:
                    dup.cancel()
        finally:
            held.release()
    finally:
        await engine.shutdown()


def test_offline_bad_prompt_fails_the_call_before_running_anything(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory=8 << 20, max_model_len=128)
    with pytest.raises(InvalidRequestError, match="prompt has 200 tokens"):
        llm.generate([[1, 2, 3], [4] * 200], SamplingParams(max_tokens=4))
    assert llm.stats()["steps"] == 0
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
