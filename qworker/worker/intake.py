"""Intake: a fetched record -> a queued ``JobState``, or an answer at once.

Owns the structured-output validations in flight (one task per job whose grammar compiles
before it queues), so a drain can cancel them. Steps for one record: register its offset as
unfinished (a refetch is skipped); decode it off the loop; dead-letter unparseable bytes;
answer a schema-invalid job, a wrong model or an unknown LoRA adapter (``Adapters.resolve``),
a past deadline or a cancelled id at once; attach a duplicate id to the job it repeats; else register the job, tokenize and check it on a thread,
validate its structured-output spec if any, and push it on the pending queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from aiokafka import TopicPartition
from aiokafka.errors import CorruptRecordException, KafkaError
from pydantic import BaseModel

from qworker.telemetry.job import JobTelemetry
from qworker.worker import consumer as kc
from qworker.worker.decode import Decoded, Invalid, Unparseable, Valid, decode
from qworker.worker.dlq import dlq_headers, with_original
from qworker.worker.jobs import JobState, cancelled_completion, error_message, log_fields
from qworker.worker.offsets import record_fingerprint
from qworker.worker.wire import answer_headers
from qworker.worker.wire import shape as answer_shape

if TYPE_CHECKING:
    from qworker.worker.app import Worker
    from qworker.worker.rawfetch import RefusedBatch

log = logging.getLogger("qworker.worker")


class Intake:
    def __init__(self, worker: Worker):
        self.w = worker  # consumer, pauser, settings, engine, registry, answers, offset tracker
        self.validating: dict[asyncio.Task, JobState] = {}  # jobs whose grammar compiles at admission
        self._refused_turn = 0  # which partition with a refused batch goes first (see skip_refused)

    async def poll_loop(self) -> None:
        """Never ends before ``stop``: a poll loop that dies leaves its partitions held and
        unanswered (the consumer keeps heartbeating), so every round's failure is contained."""
        while not self.w.closed:
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - logged; the next round starts afresh
                log.exception("poll round failed")
                await asyncio.sleep(0.2)

    async def poll_once(self) -> None:
        w = self.w
        assert w.consumer is not None and w.pauser is not None and w.registry.wake is not None
        await w.partitions.resets.restart_due()
        # fetched and not yet admitted: the pending queue and the jobs whose grammar compiles (a
        # burst of distinct schemas would otherwise fetch the whole topic while they compile)
        held = len(w.registry.pending) + len(self.validating)
        want_pause = w.draining or w.admission.should_pause(held, w.pauser.paused)
        try:
            if w.pauser.apply(want_pause):
                w.stats.pause_events += 1
        except (KafkaError, AssertionError) as e:  # assignment changing under us: next round
            log.debug("pause/resume skipped: %r", e)
        room = max(1, w.settings.max_waiting_jobs - held)
        try:
            # Polling continues while paused: it keeps this member alive in the group
            # (max_poll_interval_ms) however long the engine works.
            batches = await kc.getmany(w.consumer, timeout_ms=100, max_records=room)
        except CorruptRecordException as e:  # a CRC or a record aiokafka's parser refuses
            log.warning("poll: corrupt record batch (%r); reading it raw", e)
            await self.skip_refused(room)
            return
        except KafkaError as e:
            log.warning("poll failed: %r", e)
            await asyncio.sleep(0.2)
            return
        except Exception as e:  # noqa: BLE001 - aiokafka could not decode a record (header key not UTF-8)
            log.warning("poll: undecodable record (%r); reading its batch raw", e)
            await self.skip_refused(room)
            return
        w.partitions.resets.note_ends()
        w.partitions.note_log_ends()
        await self.handle_records([(tp, rec) for tp, records in batches.items() for rec in records], w.partitions.epoch)

    def maybe_answered(self, job_id: str, tp: TopicPartition, offset: int) -> bool:
        """Whether the partition's previous owner may have answered this record (it was in the log
        at the take) and this pod has not yet answered its id with the usual rank; where not, the
        id's answers from here on are of the usual rank (a later record here: a resubmission)."""
        attempts = self.w.registry.attempts
        if self.w.partitions.maybe_answered_before(tp, offset) and not attempts.ranked(job_id):
            return True
        attempts.rank(job_id)
        return False

    def dead_letter_copy(self, d: Invalid, tp: TopicPartition, rec: Any) -> None:
        """The record byte for byte on the DLQ, where its decoding asks for one (``too_deep``)."""
        if d.dead_letter:
            copy = with_original(rec.headers, dlq_headers(d.dead_letter, d.message, tp.topic, tp.partition, rec.offset, rec.timestamp))
            self.w.answers.publish_side(self.w.settings.dlq_topic, rec.key, rec.value, copy, [])

    def attach(self, holder: JobState, tp: TopicPartition, rec: Any) -> None:
        """A record carrying the id of a job in flight: answered by that run, committed with it."""
        holder.waiters.append((tp, rec.offset))
        holder.waiter_records[tp, rec.offset] = (rec.key, rec.headers)
        self.w.stats.duplicates += 1

    async def handle_records(self, records: list[tuple[TopicPartition, Any]], epoch: int) -> None:
        """Decode and register each record; then tokenize the new jobs off the event loop. The
        poll loop waits for this, so one poll's work (at most ``max_waiting_jobs`` records) is
        done before the next fetch: the loop stays responsive and memory stays bounded.

        ``epoch``: ``Partitions.epoch`` when the records were fetched. A rebalance while they are
        decoded may have moved a partition away and back: the consumer then rewound to the
        committed offset, and registering these records in the fresh tracker would mark the
        offsets below them seen (the rewound fetch would skip those jobs, the next commit step
        over them). So they are dropped; the rewound consumer fetches them again."""
        fresh: list[JobState] = []
        # Decoded on a thread: a record the decoders refuse (valid JSON nested a million deep) is
        # scanned in pure Python, seconds for a few MB, which on the loop would stop heartbeats,
        # streams and probes for as long. One hop per poll, not per record.
        decoded = await asyncio.to_thread(lambda: [_decode(rec) for _, rec in records]) if records else []
        if self.w.partitions.epoch != epoch:
            log.info("a rebalance while %d fetched records were decoded: they are fetched again", len(records))
            return
        for (tp, rec), d in zip(records, decoded):
            try:
                st = self.on_record(tp, rec, d)
            except Exception:  # noqa: BLE001 - one record must never kill the worker
                log.exception("record %s/%s@%s failed", tp.topic, tp.partition, rec.offset)
                continue
            if st is not None:
                fresh.append(st)
        if fresh:
            for st, err in zip(fresh, await asyncio.to_thread(lambda: [self.safe_precheck(st) for st in fresh])):
                if err is None and getattr(st.params, "structured_outputs", None) is not None and hasattr(self.w.engine, "validate_structured"):
                    self.start_validation(st)  # its grammar compiles on a thread; it queues after
                else:
                    self.queue(st, err)
        if records:
            self.w.registry.poke()

    async def skip_refused(self, room: int) -> None:
        """aiokafka refuses a partition's whole fetch while one of its batches holds a record it
        cannot decode (a header key that is not UTF-8, or null) or fails its CRC, and the broker
        serves that batch whole however far past the bad record the consumer seeks. So read the
        partition raw up to and through that batch: answer its readable records as any others,
        dead-letter the ones aiokafka refuses (or, when the batch's bytes cannot be trusted, the
        batch as one record), and seek past the batch; otherwise the partition would never be
        answered again. At most ``room`` records are taken (``max_waiting_jobs`` holds here too),
        shared evenly among the partitions found, the first one in turn (a large batch on one
        must not starve a small one on another); the rest of a batch waits for later polls, which
        meet the same refusal and resume after the last record taken. Paused partitions are left
        for when they resume; nothing is taken or sought once a rebalance began (see
        ``handle_records``)."""
        from qworker.worker.rawfetch import refused_batches

        w = self.w
        assert w.consumer is not None
        epoch, paused = w.partitions.epoch, w.consumer.paused()
        tps = sorted((tp for tp in w.consumer.assignment() if tp not in paused), key=lambda tp: (tp.topic, tp.partition))
        try:
            found = await refused_batches(w.consumer, tps)
        except KafkaError as e:
            log.warning("raw fetch failed: %r", e)
            await asyncio.sleep(0.2)
            return
        if not found:
            await asyncio.sleep(0.2)
            return
        turn = self._refused_turn % len(found)
        self._refused_turn += 1
        order = list(found.items())
        share = -(-room // len(order))  # ceil: every partition found takes at least one record
        for tp, batch in order[turn:] + order[:turn]:
            if room <= 0:
                return
            records = batch.before + (batch.records or [])
            taken = records[:min(share, room)]
            room -= len(taken)
            await self.handle_records([(tp, r) for r in taken], epoch)
            if w.partitions.epoch != epoch or tp not in w.consumer.assignment():
                return  # the rewound consumer meets the batch again
            whole = len(taken) == len(records)
            if whole and batch.records is None:
                self.dead_letter_batch(tp, batch)
            w.consumer.seek(tp, batch.next_offset if whole else taken[-1].offset + 1)  # taken is never empty unless whole

    def dead_letter_batch(self, tp: TopicPartition, batch: RefusedBatch) -> None:
        """A batch whose bytes cannot be trusted (its CRC does not hold, or they do not parse): its
        bytes as fetched go to the DLQ as one record, tracked at the batch's last offset."""
        w, last = self.w, batch.next_offset - 1
        if tp not in w.consumer.assignment() or not w.tracker.add(tp, last):
            return
        w.stats.records += 1
        w.stats.dlq += 1
        message = f"record batch at offsets {batch.first_offset}-{last} refused ({batch.reason}); the value is the batch as fetched"
        headers = dlq_headers("corrupt_batch", message, tp.topic, tp.partition, batch.first_offset, None)
        tele = w.telemetry.job("", tp.topic, tp.partition, last, None, None, time.time())
        w.answers.publish_side(w.settings.dlq_topic, None, batch.raw, headers, [(tp, last)], tele, ("dlq", "corrupt_batch"))

    def on_record(self, tp: TopicPartition, rec: Any, d: Decoded | Exception) -> JobState | None:
        """Answer at once what can be answered without the tokenizer; returns a new job (already
        registered in the registry, so duplicates and cancels find it) that needs ``precheck``."""
        w, reg, answers = self.w, self.w.registry, self.w.answers
        if tp not in w.consumer.assignment():
            return None  # revoked while this batch was being handled
        if not w.tracker.add(tp, rec.offset, record_fingerprint(rec)):
            w.stats.refetched += 1
            return None
        w.stats.records += 1
        now = time.time()
        if isinstance(d, Exception):
            raise d
        if isinstance(d, Unparseable):
            # the original key, value and headers byte for byte (null stays null), then ours
            headers = with_original(rec.headers, dlq_headers(d.code, d.message, tp.topic, tp.partition, rec.offset, rec.timestamp))
            w.stats.dlq += 1
            tele = self.job_telemetry("", tp, rec, now)
            answers.publish_side(w.settings.dlq_topic, rec.key, rec.value, headers, [(tp, rec.offset)], tele, ("dlq", d.code))
            return None
        if isinstance(d, Invalid) and d.job_id in reg.jobs:
            # the id of a job in flight: attached to that run and answered by it, as a valid copy
            # would be; its own error would outrank the run's answer (helper-103)
            self.attach(reg.jobs[d.job_id], tp, rec)
            self.dead_letter_copy(d, tp, rec)  # still kept for an operator
            return None
        if isinstance(d, Invalid):
            w.stats.errors += 1
            # no run: below every earlier answer where a previous owner may have answered the record (see unstarted_answer)
            attempt = 0 if self.maybe_answered(d.job_id, tp, rec.offset) else reg.attempts.next(d.job_id, w.generation)
            msg = error_message(d.job_id, d.code, d.message, retryable=False, metadata=d.metadata, attempt=attempt)
            tele = self.job_telemetry(d.job_id, tp, rec, now)
            headers = answer_headers(msg, d.wire)
            shape = answer_shape(d.wire, w.token_text, d.param)
            msg, data = answers.encoded(msg, headers, shape)
            self.dead_letter_copy(d, tp, rec)  # answered, and also kept for an operator (best effort: the answer moves the offset)
            answers.publish_side(w.settings.completions_topic, d.job_id, data, headers or None, [(tp, rec.offset)], tele, ("error", d.code),
                                 answer=(msg, shape))
            return None
        assert isinstance(d, Valid)
        job = d.job
        holder = reg.jobs.get(job.id)
        if holder is not None:
            self.attach(holder, tp, rec)
            return None
        ts = rec.timestamp / 1000 if rec.timestamp and rec.timestamp > 0 else now
        st = JobState(job=job, tp=tp, offset=rec.offset, produced_at=min(ts, now), received_at=now, wire=d.wire)
        st.maybe_answered = self.maybe_answered(job.id, tp, rec.offset)
        st.attempt = reg.attempts.next(job.id, w.generation)
        st.tele = self.job_telemetry(job.id, tp, rec, now)
        if job.id in w.cancels:
            answers.finish_now(st, cancelled_completion(st, st.model_name(w.model_name)))
            return None
        err = self.quick_check(st)
        if err is not None:
            answers.finish_now(st, err)
            return None
        reg.jobs[job.id] = st
        return st

    def start_validation(self, st: JobState) -> None:
        """A job with a structured-output spec: compile (or find cached) its grammar on a worker
        thread, then queue it, or answer it with ``invalid_structured_output`` before it takes
        any engine time. One task per job, so a slow compile holds up no other job (nor the poll
        loop, which does not wait for it)."""
        task = asyncio.create_task(self.validate_structured(st), name=f"validate:{st.job.id}")
        self.validating[task] = st
        task.add_done_callback(lambda t: self.validating.pop(t, None))

    async def validate_structured(self, st: JobState) -> None:
        from qworker.engine.sampling_params import InvalidRequestError

        err = None
        try:
            await self.w.engine.validate_structured(st.params)
            st.structured_validated = True
        except InvalidRequestError as e:
            err = error_message(st, e.code, str(e), retryable=False)
        except Exception as e:  # noqa: BLE001 - the job must be answered, not dropped
            # not the spec's fault (the compiler refuses a spec with InvalidRequestError): retryable
            err = error_message(st, "engine_error", f"{type(e).__name__}: {e}"[:2000], retryable=True)
        self.queue(st, err)
        self.w.registry.poke()

    def queue(self, st: JobState, err: BaseModel | None) -> None:
        """After tokenizing: queue the job, or answer it. It may have been abandoned (revoke)
        or cancelled meanwhile."""
        w, reg = self.w, self.w.registry
        if reg.jobs.get(st.job.id) is not st:
            return  # abandoned while tokenizing: the partition's new owner answers it
        if err is None and st.job.id in w.cancels:
            err = cancelled_completion(st, st.model_name(w.model_name))
        if err is not None:
            reg.forget(st)
            w.answers.finish_now(st, err)
            return
        reg.pending.push(st.job.priority, st)
        st.tele.queued()

    def job_telemetry(self, job_id: str, tp: TopicPartition, rec: Any, received_at: float, headers: Any = ...) -> JobTelemetry:
        assert self.w.telemetry is not None
        return self.w.telemetry.job(job_id, tp.topic, tp.partition, rec.offset, rec.key, rec.headers if headers is ... else headers, received_at)

    def quick_check(self, st: JobState) -> BaseModel | None:
        job, w = st.job, self.w
        if job.model is not None or job.lora is not None:
            r = w.adapters.resolve(job.model, job.lora, w.settings.lora_enabled)
            if r.code is not None:
                return error_message(st, r.code, r.message, retryable=False)
            if r.lora is not None:
                st.lora = r.lora
                st.tele.set_lora(r.lora.lora_name)
        if job.deadline is not None and time.time() > job.deadline:
            return error_message(st, "deadline_exceeded", f"deadline {job.deadline} passed before the job started", retryable=False)
        return None

    def safe_precheck(self, st: JobState) -> BaseModel | None:
        """``precheck`` that answers instead of raising: one poll's jobs are checked in one call,
        and an exception there would strand all of them (unanswered, their offsets pinned)."""
        try:
            return self.precheck(st)
        except Exception as e:  # noqa: BLE001 - every job must be answered
            log.exception("precheck failed", extra=log_fields(st))
            return error_message(st, "internal_error", f"{type(e).__name__}: {e}"[:2000], retryable=True)

    def precheck(self, st: JobState) -> BaseModel | None:
        """Reject what can never run. Fills ``prompt_ids`` and ``params``. Runs in a worker
        thread (tokenizing a 4 MB prompt takes seconds): it touches only ``st`` and the
        engine's thread-safe tokenizer, checks and capacity snapshot."""
        from qworker.engine.sampling_params import InvalidRequestError, SamplingParams

        from qworker.engine.structured.spec import from_response_format

        job, engine = st.job, self.w.engine
        try:
            st.params = SamplingParams(**job.sampling.engine_kwargs(), structured_outputs=from_response_format(job.response_format))
            st.prompt_ids = list(engine.encode(job.prompt_input()))
            engine.check(st.prompt_ids, st.params)
        except InvalidRequestError as e:
            return error_message(st, e.code, str(e), retryable=False)
        except Exception as e:  # noqa: BLE001 - e.g. the tokenizer choking on odd input
            return error_message(st, "invalid_prompt", f"{type(e).__name__}: {e}"[:2000], retryable=False)
        total = getattr(engine.capacity(), "total_tokens", None)
        if total is not None and st.prompt_len + 1 > total:
            return error_message(st, "prompt_too_long", f"prompt has {st.prompt_len} tokens; the KV cache holds {total}", retryable=False)
        return None


def _decode(rec: Any) -> Decoded | Exception:
    """``decode`` of the record's value, its failure (a bug) kept for the record it belongs to. A
    record read past aiokafka (``rawfetch.RawRecord``) whose header keys aiokafka refuses goes to
    the DLQ whatever its value: its headers cannot be produced again as they are."""
    bad = getattr(rec, "bad_header_keys", None)
    if bad:
        keys = ", ".join("null" if k is None else k.hex() for k in bad)
        return Unparseable("bad_headers", f"header key(s) null or not UTF-8 (hex): {keys}")
    try:
        return decode(rec.value)
    except Exception as e:  # noqa: BLE001 - one record must never lose the others of its poll
        return e
