"""Hypothesis fuzzing: a few thousand job payloads, valid and not; each record gets exactly one
completion, error or DLQ entry, and the worker survives. Most payloads are rejected before the
engine; the valid ones ask for one or two tokens of a short prompt."""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from qworker.worker import Worker
from qworker.worker.client import submit
from qworker.worker.decode import usable_id

from .conftest import Results, wait_committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

N = int(os.environ.get("QWORKER_FUZZ_N", "2000"))

odd_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=8)
# Positive integers stay tiny (or absurdly large): a fuzzed max_tokens must not make the model
# generate for long.
weird = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), -1), st.integers(0, 2), st.integers(2**63, 2**70), st.floats(allow_nan=False), odd_text,
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@st.composite
def base_job(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(["prompt", "messages", "prompt_token_ids"]))
    job: dict = {"id": "", "sampling": {"max_tokens": draw(st.integers(1, 2)), "temperature": draw(st.sampled_from([0.0, 0.7]))}}
    if kind == "prompt":
        job["prompt"] = draw(st.text(min_size=1, max_size=8))
    elif kind == "messages":
        job["messages"] = [{"role": draw(st.sampled_from(["user", "system"])), "content": draw(st.text(max_size=8))}]
    else:
        job["prompt_token_ids"] = draw(st.lists(st.integers(0, 49151), min_size=1, max_size=8))
    for k, strat in [("stream", st.booleans()), ("priority", st.integers(-5, 5)), ("metadata", st.dictionaries(st.text(max_size=4), st.one_of(odd_text, st.integers()), max_size=2))]:
        if draw(st.booleans()):
            job[k] = draw(strat)
    if draw(st.booleans()):
        job["sampling"].update(draw(st.fixed_dictionaries({}, optional={"top_k": st.integers(0, 5), "seed": st.integers(0, 10), "n": st.integers(1, 2), "logprobs": st.integers(0, 2), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2)})))
    return job


@st.composite
def mutated(draw: st.DrawFn) -> dict:
    job = draw(base_job())
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top", "sampling"]))
        target = job if where == "top" or not isinstance(job.get("sampling"), dict) else job["sampling"]
        action = draw(st.sampled_from(["set", "delete", "extra"]))
        keys = list(target) or ["x"]
        if action == "delete":  # dropping max_tokens would mean the default, 16 tokens: keep it
            target.pop(draw(st.sampled_from([k for k in keys if k not in ("sampling", "max_tokens")] or ["x"])), None)
        elif action == "set":
            target[draw(st.sampled_from(keys + ["prompt", "deadline", "model", "max_tokens", "temperature", "top_p"]))] = draw(weird)
        else:
            target[draw(st.text(min_size=1, max_size=5))] = draw(weird)
    return job


raw = st.one_of(st.binary(max_size=40), st.sampled_from([b"null", b"[]", b"42", b'"id"', b"{", b"{}"]))
# about 5% untouched valid jobs, 70% mutated (most of them invalid), 25% raw bytes
payloads = st.integers(0, 19).flatmap(
    lambda k: base_job().map(lambda j: ("job", j)) if k == 0 else mutated().map(lambda j: ("job", j)) if k < 15 else raw.map(lambda b: ("raw", b))
)


def generate(n: int) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []

    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(payloads)
    def collect(p: tuple[str, object]) -> None:
        out.append(p)

    collect()
    return out


async def test_fuzz_every_record_answered_once(real_engine, topics, results: Results) -> None:
    eng, _ = real_engine
    cases = generate(N)
    records: list[object] = []
    answerable: set[str] = set()
    for i, (kind, p) in enumerate(cases):
        if kind == "job" and isinstance(p, dict) and isinstance(p.get("id"), str) and p["id"] == "":
            p["id"] = f"fz{i}"  # unique, so each record's answer can be told apart
        if kind == "job" and isinstance(p, dict) and usable_id(p.get("id")) and "id" in p:
            if p["id"] in answerable:
                p["id"] = f"{p['id']}~{i}"
            answerable.add(p["id"])
        records.append(p)
    s = topics.model_copy(update={"max_waiting_jobs": 32})
    w = Worker(s, eng)
    await w.start()
    try:
        await submit(s, records)  # dicts are JSON-encoded (big ints and lone surrogates included), bytes go raw
        await results.wait(lambda: results.finals() >= len(records), 240, f"{len(records)} answers")
        await asyncio.sleep(0.5)
        assert set(results.completions) == answerable
        assert all(len(v) == 1 for v in results.completions.values()), "a record answered twice"
        assert len(results.dlq) == len(records) - len(answerable)
        kinds = {}
        for v in results.completions.values():
            key = v[0]["type"] if v[0]["type"] != "error" else v[0]["error"]["code"]
            kinds[key] = kinds.get(key, 0) + 1
        print(f"fuzz: {len(records)} records -> {kinds}, dlq {len(results.dlq)}")
        errs = [v[0]["error"]["message"] for v in results.completions.values() if v[0]["type"] == "error" and v[0]["error"]["code"] == "engine_error"]
        print("ENGINE_ERRORS", errs[:5])
        assert kinds.get("completion", 0) > 0 and kinds.get("invalid_job", 0) > 0
        assert all(not t.done() for t in w._loops), "a worker loop died"
        await wait_committed(s)
    finally:
        await w.stop()
