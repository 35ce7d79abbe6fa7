"""Answers: a job's final message encoded within the size limit, delivered, counted; side topics.

Owns the set of background publications (DLQ copies, immediate errors, early cancels) so that a
drain can wait for them. Invariants:

- An answer is never unsendable: a result that cannot be serialised, or whose shaped bytes
  exceed ``max_message_bytes``, is replaced by a small error saying so (its metadata dropped if
  even that is too big); a broker that refuses the answer as too large gets that small error.
- A record's offset is marked done only once the broker acknowledged what answers it; a
  delivery given up (drain timeout) or refused for a reason other than size leaves it
  uncommitted.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from aiokafka import TopicPartition
from pydantic import BaseModel

from qworker.messages import Completion, JobError, dumps
from qworker.telemetry.job import JobTelemetry
from qworker.worker.jobs import JobState, unstarted_answer
from qworker.worker.publisher import DeliveryAborted, DeliveryRefused, record_size
from qworker.worker.wire import Shape, answer_headers
from qworker.worker.wire import shape as answer_shape

if TYPE_CHECKING:
    from qworker.worker.app import Worker

log = logging.getLogger("qworker.worker")

# Room left in a record for headers (traceparent, tracestate) when checking a result's size.
HEADER_ROOM = 1024


def outcome_of(msg: BaseModel) -> tuple[str, str | None]:
    """(outcome, error code) of a final message, for the jobs counter and the job's span."""
    if isinstance(msg, Completion):
        return ("cancelled", None) if msg.status == "cancelled" else ("completed", None)
    return "error", getattr(getattr(msg, "error", None), "code", None)


def replace(msg: BaseModel, code: str, message: str) -> JobError:
    """A small non-retryable error standing in for ``msg`` (same job, attempt, run, metadata)."""
    info = {"code": code, "message": message, "retryable": False}
    return JobError.model_validate({"job_id": getattr(msg, "job_id", ""), "attempt": getattr(msg, "attempt", 0), "run_id": getattr(msg, "run_id", ""), "error": info, "metadata": getattr(msg, "metadata", None)})


def refused_as_too_large(msg: BaseModel, e: DeliveryRefused) -> JobError:
    """The small error that answers in place of ``msg`` when the broker refused it as too large."""
    return replace(msg, "result_too_large", f"the broker refused the result: {e}"[:2000]).model_copy(update={"metadata": None})


class Answers:
    def __init__(self, worker: Worker):
        self.w = worker  # settings, publisher, stats, token text, offset tracker
        self.side: set[asyncio.Task] = set()  # DLQ/error/cancel publications in flight

    def encoded(self, msg: BaseModel, headers: list | None = None, shape: Shape = dumps) -> tuple[BaseModel, bytes]:
        """The answer's bytes in the job's format (``shape``), never unsendable: a result that
        cannot be serialised or exceeds ``max_message_bytes`` is replaced by a small error saying
        so (``internal_error`` / ``result_too_large`` with both sizes), whose metadata is dropped
        if even that is too big. The limit applies to the shaped bytes, which are what goes out."""
        key = getattr(msg, "job_id", "")
        max_bytes = self.w.settings.max_message_bytes
        limit = max_bytes - HEADER_ROOM
        try:
            data = shape(msg)
        except Exception as e:  # noqa: BLE001 - e.g. metadata pydantic cannot serialise
            msg, data = replace(msg, "internal_error", f"could not serialise the result: {type(e).__name__}: {e}"[:2000]), b""
        else:
            size = record_size(key, data, headers)
            if size <= limit:
                return msg, data
            msg = replace(msg, "result_too_large", f"the result is {size} bytes; the limit (max_message_bytes) is {max_bytes}")
        try:
            data = shape(msg)
        except Exception:  # noqa: BLE001
            data = b""
        if not data or record_size(key, data, headers) > limit:
            assert isinstance(msg, JobError)
            msg = msg.model_copy(update={"metadata": None})
            data = shape(msg)
        return msg, data

    async def deliver(self, topic: str, key: str, msg: BaseModel, headers: list | None, shape: Shape = dumps) -> BaseModel:
        """Deliver a final answer; returns what was published (an error may replace it)."""
        publisher = self.w.publisher
        assert publisher is not None
        msg, data = self.encoded(msg, headers, shape)
        try:
            await publisher.deliver(topic, key, data, headers)
        except DeliveryRefused as e:  # e.g. a broker limit below ours: answer with a small error
            if not e.too_large:
                raise
            small = refused_as_too_large(msg, e)
            await publisher.deliver(topic, key, shape(small), headers)
            return small
        return msg

    def count(self, msg: BaseModel) -> None:
        stats = self.w.stats
        if isinstance(msg, Completion):
            if msg.status == "cancelled":
                stats.cancelled += 1
            else:
                stats.completed += 1
        else:
            stats.errors += 1

    def finish_now(self, st: JobState, msg: BaseModel) -> None:
        """Publish an immediate answer (error or early cancel) for a job that never runs (ranked
        as :func:`~qworker.worker.jobs.unstarted_answer` says)."""
        msg = unstarted_answer(st, msg)
        headers = answer_headers(msg, st.wire)
        shape = answer_shape(st.wire, self.w.token_text)
        msg, data = self.encoded(msg, headers, shape)
        self.count(msg)
        self.publish_side(self.w.settings.completions_topic, st.job.id, data, headers or None, st.offsets(), st.tele, outcome_of(msg),
                          answer=(msg, shape))

    def publish_side(
        self,
        topic: str,
        key: bytes | str | None,
        value: bytes | None,
        headers: list | None,
        offsets: list[tuple[TopicPartition, int]],
        tele: JobTelemetry | None = None,
        outcome: tuple[str, str | None] | None = None,
        answer: tuple[BaseModel, Shape] | None = None,
    ) -> None:
        """Publish in the background; once acknowledged, mark ``offsets`` done and record the
        job's ``outcome`` (outcome, error code) on ``tele``. ``key`` and ``value`` go out as
        given (a DLQ copy keeps the original bytes, None included). ``answer``: the job's answer
        that ``value`` encodes and its shape; a broker that refuses it as too large (its limit
        below ours) gets the small ``result_too_large`` error instead, as :meth:`deliver` does."""
        w = self.w

        async def send(data: bytes | None) -> None:
            if tele is None or topic == w.settings.dlq_topic:
                # a DLQ copy keeps the original headers as they were (no traceparent swap)
                await w.publisher.deliver(topic, key, data, headers)
            else:
                with tele.publish(topic, headers) as h:
                    await w.publisher.deliver(topic, key, data, h or None)

        async def go() -> None:
            nonlocal outcome
            try:
                try:
                    await send(value)
                except DeliveryRefused as e:
                    if not (e.too_large and answer is not None):
                        raise
                    small = refused_as_too_large(answer[0], e)
                    await send(answer[1](small))
                    outcome = outcome_of(small)
            except DeliveryAborted:
                if tele is not None:
                    tele.outcome("abandoned")
                return  # stays uncommitted
            except DeliveryRefused as e:
                if not e.too_large:  # not authorised, no such topic: stays uncommitted
                    log.error("%s refused the record for %s: %s; leaving it uncommitted", topic, offsets, e, extra=tele.log_fields() if tele is not None else None)
                    if tele is not None:
                        tele.outcome("error", "undeliverable")
                    return
                # a DLQ copy (an answer got its small error above): retrying would pin the
                # partition, and the record cannot be answered anyway; log loudly and move on
                log.error("%s refused the record for %s: %s; committing past it", topic, offsets, e, extra=tele.log_fields() if tele is not None else None)
            for tp, off in offsets:
                w.tracker.done(tp, off)
            if tele is not None and outcome is not None:
                tele.outcome(*outcome, partition=offsets[0][0].partition, offset=offsets[0][1])

        t = asyncio.create_task(go())
        self.side.add(t)
        t.add_done_callback(self.side.discard)
