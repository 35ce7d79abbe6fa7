"""Regressions from helper-47's attack on the async engine (2026-12-06). Before the fixes each of
the first four left a stream waiting forever (the engine thread had died, or a request had left
every list), and the last cut a stop string's text behind what had been streamed.

1. A tokenizer failing on one request's last piece: the abort's flush raised again and ended the
   engine thread (and the request's blocks leaked).
2. A failure while building one request's output ended the engine thread.
3. A request that expired in a step whose scheduling then raised was in no list any more.
4. A stream whose event loop had closed ended the engine thread (others' loops then waited).
5. With ``min_tokens``, a stop string streamed before it counted was found later when a longer
   stop string widened the search: the final text ended behind what had been streamed.
6. A shutdown ended every stream as "abort" with no error code, so a caller could not tell it from
   its own cancel (a request worth redoing elsewhere from one nobody wants).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from qworker import AsyncEngine, SamplingParams
from qworker.engine import async_engine, llm_engine
from qworker.engine import requests as requests_module
from qworker.engine.detokenizer import IncrementalDetokenizer
from tests.engine.engine_support import HeldForward

pytestmark = pytest.mark.timeout(120)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def tokens(outs: list) -> list[int]:
    """The token ids of a stream's deltas, in order."""
    return [t for o in outs for c in o.outputs for t in c.token_ids]


async def collect(e: AsyncEngine, rid: str, prompt, params: SamplingParams) -> list:
    return [o async for o in e.generate(rid, prompt, params)]


async def _started(tiny_model_dir, **kw) -> AsyncEngine:
    e = AsyncEngine.from_model(str(tiny_model_dir), kv_cache_memory=8 << 20, **kw)
    await e.start()
    return e


async def _settle(tasks, timeout: float = 20):
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    assert not pending, "a stream was never ended"
    return [t.result() if not t.exception() else t.exception() for t in tasks]


def _fail_decoding(monkeypatch, poison: int, when) -> None:
    """Requests whose prompt holds ``poison`` get a detokenizer whose decode raises (as a broken
    tokenizer would) whenever ``when(detokenizer, prompt_ids)`` says so."""

    class Failing(IncrementalDetokenizer):
        def __init__(self, tokenizer, prompt_ids, *a, **k):
            super().__init__(tokenizer, prompt_ids, *a, **k)
            if poison in prompt_ids:
                real = self._decode

                def decode(ids):
                    if when(self, prompt_ids):
                        raise RuntimeError("tokenizer: decode failed (injected)")
                    return real(ids)
                self._decode = decode

    monkeypatch.setattr(requests_module, "IncrementalDetokenizer", Failing)


async def test_a_tokenizer_failing_on_one_request_ends_streams_and_frees_blocks(tiny_model_dir, monkeypatch):
    poison = 4242
    _fail_decoding(monkeypatch, poison, lambda detok, prompt_ids: len(detok.ids) >= len(prompt_ids) + 3)
    e = await _started(tiny_model_dir)
    try:
        used = e.engine.stats()["kv_blocks_used"]
        results = await _settle([asyncio.create_task(collect(e, "good", [5, 6, 7, 8], greedy(30))),
                                 asyncio.create_task(collect(e, "bad", [5, 6, 7, poison], greedy(30)))])
        assert all(isinstance(r, list) and r[-1].finished for r in results)
        assert e._thread.is_alive()
        (later,) = await _settle([asyncio.create_task(collect(e, "later", [9, 10], greedy(3)))])
        assert len(tokens(later)) == 3  # the engine still serves
        assert e.engine.stats()["kv_blocks_used"] == used
    finally:
        await e.shutdown()


async def test_a_failure_building_one_requests_output_fails_that_request_alone(tiny_model_dir, monkeypatch):
    real = async_engine.delta_output

    def delta_output(req):
        if req.request_id == "bad" and req.seqs[0].num_output_tokens >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return real(req)

    monkeypatch.setattr(async_engine, "delta_output", delta_output)
    e = await _started(tiny_model_dir)
    try:
        good, bad = await _settle([asyncio.create_task(collect(e, "good", [5, 6, 7], greedy(30, logprobs=2))),
                                   asyncio.create_task(collect(e, "bad", [5, 6, 8], greedy(30, logprobs=2)))])
        assert isinstance(bad, UnicodeDecodeError)
        assert len(tokens(good)) == 30 and good[-1].outputs[0].finish_reason == "length"
        (later,) = await _settle([asyncio.create_task(collect(e, "later", [9, 10], greedy(3)))])
        assert later[-1].finished
        assert "bad" not in e.engine.requests
    finally:
        await e.shutdown()


class _ShiftedClock:
    """Stands in for ``llm_engine``'s ``time`` module: ``time()`` runs ``offset`` seconds ahead."""

    def __init__(self):
        self.offset = 0.0

    def time(self):
        return time.time() + self.offset

    def __getattr__(self, name):
        return getattr(time, name)


async def _expire_in_a_failing_step(tiny_model_dir, monkeypatch, first_prompt, on_expired_step):
    """One engine slot: "first" runs, "queued" waits with a deadline that the clock then jumps
    past; ``on_expired_step()`` runs at the schedule of the step that expired it (it injects the
    failure). Returns "queued"'s one output, once "first" has ended too."""
    clock = _ShiftedClock()
    monkeypatch.setattr(llm_engine, "time", clock)
    e = await _started(tiny_model_dir, max_num_seqs=1)
    real, fired = e.engine.scheduler.schedule, []

    def schedule(*a, **k):
        if clock.offset > 0 and "queued" not in e.engine.requests and not fired:
            fired.append(1)
            on_expired_step()
        return real(*a, **k)

    e.engine.scheduler.schedule = schedule
    # "first" must still run when the clock jumps (on a fast forward its 800 tokens took < 0.6 s):
    # its fourth forward is held until then
    held = HeldForward(e.engine, passes=3)
    try:
        first = asyncio.create_task(collect(e, "first", first_prompt, greedy(800)))
        await asyncio.sleep(0.3)
        queued = asyncio.create_task(e.generate("queued", [5, 6, 8], greedy(3), deadline=time.time() + 60).__anext__())
        await asyncio.sleep(0.3)
        clock.offset = 120.0
        held.release()
        _, out = await _settle([first, queued])
        assert fired
        return out
    finally:
        held.release()
        await e.shutdown()


async def test_a_request_that_expired_in_a_failed_step_is_still_answered(tiny_model_dir, monkeypatch):
    def fail_the_schedule():  # a bookkeeping defect in the very step where "queued" expired
        raise AssertionError("scheduler bookkeeping defect (injected)")

    out = await _expire_in_a_failing_step(tiny_model_dir, monkeypatch, [5, 6, 7], fail_the_schedule)
    assert out.finished and out.error_code == "deadline_exceeded"


def test_a_stream_whose_loop_closed_does_not_end_the_engine(tiny_model_dir):
    e = AsyncEngine.from_model(str(tiny_model_dir), kv_cache_memory=8 << 20)
    held = HeldForward(e.engine)

    async def first_loop():
        await e.start()
        asyncio.create_task(e.generate("x", [5, 6, 7], greedy(100)).__anext__())
        while not held.entered.is_set():
            await asyncio.sleep(0.01)

    asyncio.run(first_loop())  # ends with "x" in flight: its loop is closed
    held.release()

    async def second_loop():
        try:
            (out,) = await _settle([asyncio.create_task(collect(e, "y", [8, 9], greedy(3)))])
            assert out[-1].finished
            await _until_gone(e, "x")
        finally:
            await e.shutdown()

    asyncio.run(second_loop())


async def _until_gone(e: AsyncEngine, rid: str) -> None:
    deadline = time.monotonic() + 10
    while rid in e.engine.requests:  # nobody reads it: aborted rather than run to its end
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("stops", [["he"], ["he", "zzzzzzzzzz"], ["he t", "zzzzzzzzzz"]])
async def test_a_longer_stop_string_does_not_move_the_cut(tiny_model_dir, stops):
    e = await _started(tiny_model_dir)
    try:
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=3, stop=stops)
        alone = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=3, stop=stops[:1])
        outs = await collect(e, "s", "Hello world, the", params)
        ref = await collect(e, "r", "Hello world, the", alone)
    finally:
        await e.shutdown()
    streamed = "".join(c.text for o in outs for c in o.outputs)
    final = outs[-1].outputs[0]
    assert streamed == "".join(c.text for o in ref for c in o.outputs)  # an unmatched stop string changes nothing
    assert final.finish_reason == ref[-1].outputs[0].finish_reason


async def test_a_request_that_expired_in_a_step_failing_after_scheduling_is_still_answered(tiny_model_dir, monkeypatch):
    # helper-48: the same as above when the step fails later (a tokenizer failing on another
    # request's token while the step's outputs are applied)
    armed, poison = [False], 4242

    def once(detok, prompt_ids) -> bool:
        fire, armed[0] = armed[0], False
        return fire

    _fail_decoding(monkeypatch, poison, once)
    out = await _expire_in_a_failing_step(tiny_model_dir, monkeypatch, [5, 6, 7, poison], lambda: armed.__setitem__(0, True))
    assert out.finished and out.error_code == "deadline_exceeded"


async def test_a_shutdown_is_told_apart_from_a_cancel(tiny_model_dir):
    e = await _started(tiny_model_dir)
    first = asyncio.Event()

    async def until_ended(rid: str) -> list:
        outs = []
        async for o in e.generate(rid, [5, 6, 7], greedy(100_000)):
            outs.append(o)
            first.set()
        return outs

    cancelled, running = asyncio.create_task(until_ended("cancelled")), asyncio.create_task(until_ended("running"))
    await asyncio.wait_for(first.wait(), 30)
    await e.abort("cancelled")
    (cut,) = await _settle([cancelled])
    await e.shutdown()
    (shut,) = await _settle([running])
    assert cut[-1].finished and cut[-1].outputs[0].finish_reason == "abort" and cut[-1].error_code is None
    assert shut[-1].finished and shut[-1].outputs[0].finish_reason == "abort"
    assert shut[-1].error_code == "engine_shutdown" and "shut down" in shut[-1].error
