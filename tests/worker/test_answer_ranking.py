"""Which answer wins under the README's "highest attempt wins": a job's real answer must not be
outranked by an error about another delivery of its id.

* A record answered by one pod and delivered again to the next past its deadline (helper-100:
  after a rebalance, its offset held back by a longer job before it in the partition): the second
  delivery's ``deadline_exceeded`` ranks below every answer. A resubmission of the id (a new
  record, after the pod took the partition) still outranks the earlier answer (helper-104).
* An invalid record with the id of a job in flight (helper-103) is attached to that run, as a
  valid copy is: its own error had the higher attempt and overruled the run's completion."""

from __future__ import annotations

import asyncio
import time

import pytest

from qworker.worker import Worker
from qworker.worker.client import submit

from .conftest import Results, wait_committed
from .test_defects import partition_of
from .test_flow import engines, job, one_torch_thread, started  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(120)


def same_partition_id(s, as_id: str, stem: str) -> str:
    return next(f"{stem}-{i}" for i in range(1000) if partition_of(s, f"{stem}-{i}") == partition_of(s, as_id))


async def test_an_invalid_copy_of_a_job_in_flight_is_answered_by_its_run(topics, results: Results, engines) -> None:
    eng = await engines()
    w = await started(topics, eng)
    try:
        await submit(topics, [job("busy", max_tokens=60)])
        await results.wait(lambda: "busy" in w.jobs and w.jobs["busy"].admitted, 30, "busy running")
        # a record the schema refuses, with the id in flight
        await submit(topics, [{"id": "busy", "prompt": "x", "sampling": {"max_tokens": "five"}}])
        await results.wait(lambda: "busy" in results.completions, 60, "busy answered")
        await wait_committed(topics)
        [answer] = results.completions["busy"]
        assert answer["type"] == "completion" and answer["status"] == "ok"
        assert w.stats.duplicates == 1
    finally:
        await w.stop()


async def test_redeliveries_do_not_outrank_the_answer_given_and_a_resubmission_does(topics, results: Results, engines) -> None:
    """Pod A answers ``x`` (and the invalid copy it attached to x's run) while ``long``, before them
    in the partition, holds the commit back; A stops. Pod B reads all three records again, past
    x's deadline: x's ``deadline_exceeded`` (helper-100) and the copy's ``invalid_job``
    (helper-105: the copy finds no run this time) must rank below A's completion. A resubmission
    of x after B took the partition is a new record: its answer ranks above every earlier one
    (helper-104)."""
    eng = await engines()
    first = await started(topics, eng)
    x = same_partition_id(topics, "long", "x")
    deadline = time.time() + 8
    try:
        await submit(topics, [job("long", max_tokens=1500), job(x, max_tokens=60, deadline=deadline)])
        await results.wait(lambda: x in first.jobs and first.jobs[x].admitted, 30, "x running")
        await submit(topics, [{"id": x, "prompt": "y", "sampling": {"max_tokens": "five"}}])  # an invalid copy, attached
        await results.wait(lambda: x in results.completions, 30, "x answered")
        assert first.stats.duplicates == 1 and "long" not in results.completions
    finally:
        await first.stop(drain_timeout_s=0.1)  # "long" is abandoned: no offset of the three is committed
    [answer] = results.completions[x]
    assert answer["type"] == "completion" and answer["status"] == "ok"
    await asyncio.sleep(max(0.0, deadline + 0.2 - time.time()))
    second = Worker(topics, eng)
    await second.start()
    try:
        await results.wait(lambda: len(results.completions[x]) == 3, 60, "both records answered again")
        assert {a["error"]["code"] for a in results.completions[x][1:]} == {"deadline_exceeded", "invalid_job"}
        assert max(results.completions[x], key=lambda a: a["attempt"]) is answer, [a["attempt"] for a in results.completions[x]]
        await submit(topics, [job(x, max_tokens=3, deadline=time.time() - 1)])  # a resubmission, past its deadline
        await results.wait(lambda: len(results.completions[x]) == 4, 30, "the resubmission answered")
        newest = results.completions[x][3]
        assert newest["error"]["code"] == "deadline_exceeded"
        assert max(results.completions[x], key=lambda a: a["attempt"]) is newest
    finally:
        await second.stop(drain_timeout_s=0.1)


@pytest.mark.parametrize("kind", ["deadline", "invalid"])
async def test_a_resubmission_in_a_fresh_pods_backlog_outranks_the_pods_own_answer(topics, results: Results, engines, kind) -> None:
    """helper-107: one pod starting on a backlog that holds x, fillers, then a resubmission of x
    (past its deadline, or invalid) fetched after x was answered: both records were in the log
    when the pod took the partition, yet this pod answered the first itself, so the second is a
    later record of the id, whose answer ranks above (it had attempt 0 and lost)."""
    s = topics.model_copy(update={"max_waiting_jobs": 1})
    eng = await engines()
    fill = [same_partition_id(s, "x", f"f{i}") for i in range(3)]
    again = job("x", max_tokens=3, deadline=time.time() - 1) if kind == "deadline" else {"id": "x", "prompt": "y", "sampling": {"max_tokens": "five"}}
    await submit(s, [job("x", max_tokens=2)] + [job(f, max_tokens=40) for f in fill] + [again])
    w = await started(s, eng)
    try:
        await results.wait(lambda: len(results.completions.get("x", [])) == 2, 90, "x answered twice")
        assert w.stats.duplicates == 0  # answered before the resubmission was fetched: not attached
        first, second = results.completions["x"]
        assert first["type"] == "completion" and second["type"] == "error"
        assert second["attempt"] > first["attempt"], (first["attempt"], second["attempt"])
    finally:
        await w.stop()
