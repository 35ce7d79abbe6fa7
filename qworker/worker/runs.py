"""Runs: admission from the pending queue, one task per admitted job, its answer, its cancel.

Owns nothing but the tasks it starts (each on its ``JobState``); the jobs and the queue are the
``Registry``'s. Invariant of a run: it ends with exactly one published answer (completion or
error) and its records marked done, or, when abandoned, with nothing published and its records
left uncommitted for the partition's next owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from pydantic import BaseModel

from qworker.worker.answers import outcome_of
from qworker.worker.jobs import JobState, cancelled_completion, error_message, log_fields
from qworker.worker.publisher import DeliveryAborted, DeliveryRefused
from qworker.worker.wire import answer_headers
from qworker.worker.wire import shape as answer_shape

if TYPE_CHECKING:
    from qworker.worker.app import Worker

log = logging.getLogger("qworker.worker")


class Runs:
    def __init__(self, worker: Worker):
        self.w = worker  # engine, runner, registry, answers, offset tracker, draining flag

    async def admit_loop(self) -> None:
        wake = self.w.registry.wake
        assert wake is not None
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await wake.wait()
            wake.clear()
            if not self.w.draining:
                try:
                    self.admit()
                except Exception:  # noqa: BLE001 - the admission loop must outlive any one job
                    log.exception("admission pass failed")

    def admit(self) -> None:
        w, reg = self.w, self.w.registry
        while len(reg.pending):
            st = reg.pending.peek()
            assert st is not None
            if st.job.deadline is not None and time.time() > st.job.deadline:
                reg.pending.pop()
                reg.forget(st)
                w.answers.finish_now(st, error_message(st, "deadline_exceeded", f"deadline {st.job.deadline} passed while queued", retryable=False))
                continue
            if not w.admission.can_admit(st, w.engine.capacity(), reg.running()):
                break
            reg.pending.pop()
            st.new_run(reg.attempts.next(st.job.id, w.generation))
            reg.attempts.rank(st.job.id)  # a run's answer keeps its attempt
            st.task = asyncio.create_task(self.run(st), name=f"job:{st.job.id}")

    async def run(self, st: JobState) -> None:
        w = self.w
        topic = w.settings.completions_topic
        try:
            try:
                result: BaseModel = await w.runner.run(st)
            except DeliveryRefused as e:  # a stream event the broker will never take
                if not e.too_large:
                    raise
                result = error_message(st, "result_too_large", f"a stream event was refused: {e}"[:2000], retryable=False)
            except (asyncio.CancelledError, DeliveryAborted):
                raise
            except Exception as e:  # noqa: BLE001 - a bug must still answer the job
                log.exception("unexpected failure of a run", extra=log_fields(st))
                result = error_message(st, "internal_error", f"{type(e).__name__}: {e}"[:2000], retryable=False)
            with st.tele.publish(topic, answer_headers(result, st.wire) or None) as headers:
                result = await w.answers.deliver(topic, st.job.id, result, headers or None, answer_shape(st.wire, w.token_text))
        except (asyncio.CancelledError, DeliveryAborted):
            # Abandoned (revoke, drain timeout): no completion, offsets stay uncommitted, the
            # partition's next owner reruns the job with a higher attempt.
            w.stats.abandoned += 1
            w.registry.forget(st)
            st.tele.outcome("abandoned")
            return
        except DeliveryRefused as e:
            # Nothing can be published for it (e.g. not authorised for the topic): leave its
            # records uncommitted rather than commit past an unanswered job; an operator must act.
            log.error("no answer can be published: %s", e, extra=log_fields(st))
            w.registry.forget(st)
            st.tele.outcome("error", "undeliverable")
            return
        w.answers.count(result)
        self.done(st)
        st.tele.outcome(*outcome_of(result), partition=st.tp.partition, offset=st.offset, output_tokens=st.generated)

    def done(self, st: JobState) -> None:
        """The job's result is acknowledged: its records may be committed past."""
        for tp, off in st.offsets():
            self.w.tracker.done(tp, off)
        self.w.registry.forget(st)

    async def cancel(self, job_id: str, made_at: float | None = None) -> None:
        """A cancel request made at Unix time ``made_at``: abort the job if we hold it;
        remember it (for ``cancel_ttl_s`` from ``made_at``) in case the job arrives later."""
        w, reg = self.w, self.w.registry
        if not w.cancels.add(job_id, made_at):
            return  # older than the TTL: a pod that read it in time would have forgotten it too
        st = reg.jobs.get(job_id)
        if st is None:
            return
        if not st.admitted:
            if reg.pending.remove(st):
                reg.forget(st)
                w.answers.finish_now(st, cancelled_completion(st, st.model_name(w.model_name)))
            return  # still tokenizing: intake's ``queue`` sees the cancel in the registry
        st.cancel_requested = True
        # Before the run called generate() the engine does not know the id: the runner sees
        # the flag and answers "cancelled" without starting. After it, commands reach the
        # engine thread in order, so this abort follows the request's "add".
        if st.in_engine and not st.gen_done:
            await w.engine.abort(st.request_id)
