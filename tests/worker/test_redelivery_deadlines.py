"""A record answered once and delivered again past its deadline (helper-100: after a rebalance,
its offset held back by a longer job before it in the partition) must not have its answer
overruled: the ``deadline_exceeded`` error of the second delivery ranks below every answer under
"highest attempt wins". The worker cannot tell a redelivery from a resubmission of the id, so
the second delivery here is the same record produced again, through the real broker."""

from __future__ import annotations

import asyncio
import time

import pytest

from qworker.worker.client import submit

from .conftest import Results
from .test_flow import engines, job, one_torch_thread, started  # noqa: F401 - fixtures

pytestmark = pytest.mark.timeout(120)


async def test_a_late_redelivery_does_not_outrank_the_answer_given(topics, results: Results, engines) -> None:
    eng = await engines()
    w = await started(topics, eng)
    try:
        record = job("answered-once", max_tokens=3, deadline=time.time() + 30)
        await submit(topics, [record])
        await results.wait(lambda: len(results.completions.get("answered-once", [])) == 1, 30)
        [first] = results.completions["answered-once"]
        assert first["type"] == "completion" and first["status"] == "ok"
        record.deadline = time.time() - 1  # the same job, delivered again after its deadline
        await submit(topics, [record])
        await results.wait(lambda: len(results.completions["answered-once"]) == 2, 30)
        second = results.completions["answered-once"][1]
        assert second["type"] == "error" and second["error"]["code"] == "deadline_exceeded"
        winner = max(results.completions["answered-once"], key=lambda a: a["attempt"])
        assert winner is first, (first["attempt"], second["attempt"])
    finally:
        await w.stop()


async def test_a_job_never_answered_still_gets_its_deadline_error(topics, results: Results, engines) -> None:
    eng = await engines()
    w = await started(topics, eng)
    try:
        await submit(topics, [job("too-late", deadline=time.time() - 1)])
        await results.wait(lambda: "too-late" in results.completions, 30)
        [only] = results.completions["too-late"]
        assert only["type"] == "error" and only["error"]["code"] == "deadline_exceeded" and only["attempt"] == 0
        await asyncio.sleep(0.5)
        assert len(results.completions["too-late"]) == 1
    finally:
        await w.stop()
