"""The worker: jobs topic -> admission -> engine -> result topics, committing only what is done.

Flow of one job record (all on one asyncio loop, so the state below needs no locks):
1. The poll loop fetches it (partitions stay polled even while paused) and registers its
   offset as unfinished in the ``OffsetTracker``.
2. It is decoded: unparseable bytes go to the DLQ; a schema-invalid job, a wrong model, a past
   deadline or a prompt that can never fit get an ``error`` message at once; a job whose id is
   already in flight is attached to that run as a waiter.
3. Valid jobs wait in the bounded ``PendingQueue``; the admission loop hands them to the engine
   while KV capacity lasts. A full queue pauses the partitions.
4. The run streams coalesced deltas, then publishes the completion; once the broker has
   acknowledged everything, the record (and its waiters) are marked finished and the commit
   loop may move the partition's committed offset past them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import asdict
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError
from pydantic import BaseModel

from qworker.config import WorkerSettings
from qworker.messages import Completion, JobError, dumps
from qworker.worker import consumer as kc
from qworker.worker.admission import Admission, PendingQueue
from qworker.worker.cancellation import CancelRegistry, CancelWatcher
from qworker.worker.decode import Decoded, Invalid, Unparseable, Valid, decode
from qworker.worker.dlq import dlq_headers, raw_headers_header, with_original
from qworker.worker.engine_start import EngineStartError, load_engine
from qworker.worker.jobs import Attempts, JobRunner, JobState, cancelled_completion, error_message, log_fields
from qworker.worker.offsets import OffsetTracker
from qworker.producer import start_producer
from qworker.worker.publisher import DeliveryAborted, DeliveryRefused, Publisher, record_size
from qworker.worker.stats import WorkerStats
from qworker.worker.wire import IdText, Shape, answer_headers, token_text
from qworker.worker.wire import shape as answer_shape
from qworker.telemetry import EngineLiveness, TelemetryServer, Tracing, WorkerMetrics, configure_tracing
from qworker.telemetry.job import JobTelemetry, Telemetry
from qworker.telemetry.tracing import TracingConfigError

log = logging.getLogger("qworker.worker")
# how long a rebalance may wait, in all, for the group's offsets of the partitions it keeps
KEPT_CHECK_TIMEOUT_S = 5.0

# The partition of a job whose log was reset under it: it still answers, marks no offset.
_DETACHED = TopicPartition("", -1)

# Room left in a record for headers (traceparent, tracestate) when checking a result's size.
_HEADER_ROOM = 1024


class StartupError(Exception):
    """A misconfiguration found at start (e.g. the probe port is taken): the CLI prints the
    one-line message and exits with status 2, no traceback."""


class Worker:
    def __init__(self, settings: WorkerSettings, engine: Any | None = None, tracing: Tracing | None = None):
        """``tracing``: a tracer to use (tests pass one with an in-memory exporter); by default
        one is built from the ``OTEL_*`` environment (no-op when it names no exporter)."""
        self.settings = settings
        self.engine = engine
        self._tracing = tracing
        self._owns_engine = engine is None
        self.stats = WorkerStats()
        self.tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self.jobs: dict[str, JobState] = {}  # by job id: pending and running
        self.pending: PendingQueue[JobState] = PendingQueue()
        self.admission = Admission(settings.max_waiting_jobs, settings.admission_reserve_tokens)
        self.cancels = CancelRegistry(settings.cancel_ttl_s)
        self.draining = False  # no new jobs; in-flight ones finish
        self.giving_up = False  # deliveries stop retrying; unfinished offsets stay uncommitted
        self.ready = False
        self.generation = 0
        self.attempts = Attempts()  # each answer to an id gets a higher attempt than the one before
        self.model_names: set[str] = set()
        self.model_name = ""
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None
        self.publisher: Publisher | None = None
        self.pauser: kc.Pauser | None = None
        self.http: TelemetryServer | None = None
        self.metrics: WorkerMetrics | None = None
        self.telemetry: Telemetry | None = None
        self.warmed_up = False
        self.token_text = IdText()  # token pieces for OpenAI logprobs: the tokenizer's once loaded
        self.joined = False  # the consumer joined its group (it may own no partition)
        self.group_health: kc.GroupHealth | None = None  # /readyz: the consumer's state as the broker confirms it
        self._cancel_watcher: CancelWatcher | None = None
        self._side: set[asyncio.Task] = set()  # DLQ/error/cancel publications
        self._validating: dict[asyncio.Task, JobState] = {}  # jobs whose grammar compiles at admission
        self._loops: list[asyncio.Task] = []
        self._wake: asyncio.Event | None = None
        self._stop_requested: asyncio.Event | None = None
        self._revoked: set[TopicPartition] = set()
        self._closed = False  # loops exit (besides being cancelled)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        s = self.settings
        self._wake, self._stop_requested = asyncio.Event(), asyncio.Event()
        # tracing first: a bad OTEL_* setting fails the start before the model loads
        try:
            tracing = self._tracing or configure_tracing()
        except TracingConfigError as e:  # one line naming the OTEL_* variable, exit 2
            raise StartupError(str(e)) from e
        name = s.model_name or (self.engine.model_name if self.engine is not None else os.path.basename(os.path.normpath(s.model or "model")))
        self.metrics = WorkerMetrics(name)
        if s.http_port >= 0:
            # up before the model loads, so a startup probe sees a live process
            self.http = TelemetryServer(
                s.http_host,
                s.http_port,
                metrics=self.metrics,
                liveness={
                    "engine_loop": EngineLiveness(lambda: self.engine, s.liveness_timeout_s, busy=self._busy),
                    "worker_loops": self.loops_alive,
                },
                readiness={
                    "model_loaded": lambda: self.engine is not None and bool(getattr(self.engine, "ready", False)),
                    "warmed_up": lambda: self.warmed_up,
                    "in_group": lambda: self.group_health is not None and self.group_health.ready(),
                    "not_draining": lambda: not self.draining,
                },
            )
            try:
                await self.http.start()
            except OSError as e:
                raise StartupError(
                    f"cannot listen on {s.http_host}:{s.http_port} for probes/metrics ({e.strerror or e}); set QWORKER_HTTP_HOST to an "
                    "address of this host and QWORKER_HTTP_PORT to a free port (0 = any free port, -1 = no HTTP server)"
                ) from e
        if self.engine is None:
            if not s.model:
                raise StartupError("no model: set QWORKER_MODEL or --model to the model directory")
            if not os.path.isfile(os.path.join(s.model, "config.json")):
                raise StartupError(f"QWORKER_MODEL={s.model!r} is not a model directory (no config.json there)")
            try:  # in a thread: the probe server keeps answering while the weights load
                self.engine = await load_engine(s)
            except EngineStartError as e:  # a device, budget or model the engine refused: one line
                raise StartupError(str(e)) from e
        if hasattr(self.engine, "stats"):
            self.metrics.attach_engine(self.engine.stats)
        self.token_text = token_text(self.engine)
        # A pod told to stop while it loads must never join the group: joining would take
        # partitions from a healthy pod (whose runs would be abandoned and rerun) only to leave.
        if self.draining:
            log.info("stop requested during start: not joining the group")
            return
        await self._warm_up()
        if self.draining:
            log.info("stop requested during warm-up: not joining the group")
            return
        self.model_name = s.model_name or self.engine.model_name
        self.telemetry = Telemetry(tracing, self.metrics, group_id=s.group_id, model=self.model_name)
        self.model_names = {self.model_name, self.engine.model_name}
        if s.model:
            self.model_names.add(os.path.basename(os.path.normpath(s.model)))
        try:
            self.producer = await start_producer(s.producer_options())  # falls back when idempotence is refused
        except KafkaConnectionError as e:
            raise StartupError(f"cannot reach Kafka at {s.bootstrap_servers!r} ({e}); check QWORKER_BOOTSTRAP_SERVERS") from e
        except KafkaError as e:  # refused even without idempotence (e.g. not authorised)
            raise StartupError(f"the Kafka producer did not start at {s.bootstrap_servers!r}: {e!r}") from e
        self.publisher = Publisher(self.producer, lambda: self.giving_up, s.max_message_bytes)
        self.runner = JobRunner(self.engine, self.publisher, s.tokens_topic, s.stream_interval_ms / 1000, self.model_name)
        if self.draining:  # the last await before subscribing: check once more
            log.info("stop requested during start: not joining the group")
            return
        self.consumer = AIOKafkaConsumer(**s.consumer_options())
        self.consumer.subscribe([s.jobs_topic], listener=kc.Listener(self._on_revoked, self._on_assigned))
        await self._connect(self.consumer)
        self.pauser = kc.Pauser(self.consumer)
        self.group_health = kc.GroupHealth(self.consumer, TopicPartition(s.jobs_topic, 0), s.ready_timeout_s)
        self._cancel_watcher = CancelWatcher(s.cancel_topic, s.consumer_options(), self.cancel, s.cancel_ttl_s)
        await self._cancel_watcher.start()
        self._loops = [
            asyncio.create_task(self._poll_loop(), name="poll"),
            asyncio.create_task(self._admit_loop(), name="admit"),
            asyncio.create_task(self._commit_loop(), name="commit"),
            asyncio.create_task(self.group_health.run(), name="group-health"),
        ]
        for t in self._loops:
            t.add_done_callback(self._loop_ended)
        self.ready = True
        log.info("worker %s up: model %s, jobs %s, group %s", s.client_id, self.model_name, s.jobs_topic, s.group_id)

    async def _connect(self, client: AIOKafkaProducer | AIOKafkaConsumer) -> None:
        """Start a Kafka client; a broker that cannot be reached at all is a startup error (one
        line naming the setting), not a traceback."""
        try:
            await client.start()
        except KafkaConnectionError as e:
            with contextlib.suppress(Exception):
                await client.stop()
            if client is self.producer:
                self.producer = None
            else:
                self.consumer = None
            raise StartupError(f"cannot reach Kafka at {self.settings.bootstrap_servers!r} ({e}); check QWORKER_BOOTSTRAP_SERVERS") from e

    def loops_alive(self) -> bool:
        """Liveness: every background loop runs (before they start, and while stopping, there is
        nothing to check). A loop that died leaves its partitions held and unanswered while the
        consumer keeps heartbeating, so it must take /healthz down."""
        if self._closed:
            return True
        loops_ok = all(not t.done() for t in self._loops)
        return loops_ok and (self._cancel_watcher is None or self._cancel_watcher.alive())

    def _loop_ended(self, t: asyncio.Task) -> None:
        if not self._closed and not t.cancelled():
            log.error("worker loop %s ended: %r; /healthz now fails", t.get_name(), t.exception())

    def request_stop(self) -> None:
        """Begin the drain (SIGTERM). Safe to call more than once."""
        self.draining = True
        self.ready = False
        if self._stop_requested is not None:
            self._stop_requested.set()

    def hurry(self) -> None:
        """Give up on in-flight work now (second SIGTERM)."""
        self.request_stop()
        self.giving_up = True
        for st in list(self.jobs.values()):
            if st.task is not None:
                st.task.cancel()

    async def wait_stop_requested(self) -> None:
        assert self._stop_requested is not None
        await self._stop_requested.wait()

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Drain: stop taking jobs, let in-flight ones finish within the timeout, abort the rest
        without committing them, commit what is done, leave the group, flush, stop the engine."""
        timeout = self.settings.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self.request_stop()
        for st in list(self.pending):  # fetched but never started: stays in Kafka for the next owner
            self.pending.remove(st)
            self._forget(st)
            st.tele.outcome("abandoned")
        for task, st in list(self._validating.items()):  # compiling its grammar: the same
            task.cancel()
            self._forget(st)
            st.tele.outcome("abandoned")
        running = [st.task for st in self.jobs.values() if st.task is not None]
        busy = running + list(self._side)
        log.info("draining: %d running jobs, %d publications", len(running), len(self._side))
        if busy:
            done, not_done = await asyncio.wait(busy, timeout=max(0.0, timeout))
            if not_done:
                log.warning("drain timeout: aborting %d unfinished jobs (left uncommitted)", len(not_done))
                self.giving_up = True
                for t in not_done:
                    t.cancel()
                await asyncio.gather(*not_done, return_exceptions=True)
        self.giving_up = True
        self._closed = True
        for t in self._loops:
            t.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self.consumer is not None:
            await self._commit()
        log.info("drain: committed; leaving the group")
        if self._cancel_watcher is not None:
            await self._cancel_watcher.stop()
        if self.consumer is not None:
            await self.consumer.stop()  # sends LeaveGroup: partitions move at once
            self.joined = False
        if self.producer is not None:
            await self.producer.stop()  # flushes
        if self._owns_engine and self.engine is not None:
            await self.engine.shutdown()
        if self.telemetry is not None:
            await self.telemetry.stop(shutdown_tracing=self._tracing is None)  # flushes queued spans
        if self.http is not None:
            await self.http.stop()
        log.info("worker stopped: %s", self.stats)

    async def close_after_failed_start(self) -> None:
        """Quietly close whatever ``start`` opened before it failed (nothing was consumed, so
        there is nothing to drain or commit)."""
        self._closed = True
        for t in self._loops:
            t.cancel()
        closers = [self._cancel_watcher.stop() if self._cancel_watcher is not None else None,
                   self.consumer.stop() if self.consumer is not None else None,
                   self.producer.stop() if self.producer is not None else None,
                   self.engine.shutdown() if self._owns_engine and self.engine is not None else None,
                   self.http.stop() if self.http is not None else None]
        for c in closers:
            if c is not None:
                with contextlib.suppress(Exception):
                    await c

    async def _warm_up(self) -> None:
        """One tiny generation before taking jobs: the first step pays one-off costs (allocator,
        kernel selection or compilation) that must not land on a job; /readyz waits for it."""
        from qworker.engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in self.engine.generate("qworker-warm-up", self.engine.encode("warm-up"), params):
            pass
        self.warmed_up = True

    # ------------------------------------------------------------------ polling
    async def _poll_loop(self) -> None:
        """Never ends before ``stop``: a poll loop that dies leaves its partitions held and
        unanswered (the consumer keeps heartbeating), so every round's failure is contained."""
        while not self._closed:
            try:
                await self._poll_once()
            except Exception:  # noqa: BLE001 - logged; the next round starts afresh
                log.exception("poll round failed")
                await asyncio.sleep(0.2)

    async def _poll_once(self) -> None:
        assert self.consumer is not None and self.pauser is not None and self._wake is not None
        want_pause = self.draining or self.admission.should_pause(len(self.pending), self.pauser.paused)
        try:
            if self.pauser.apply(want_pause):
                self.stats.pause_events += 1
        except (KafkaError, AssertionError) as e:  # assignment changing under us: next round
            log.debug("pause/resume skipped: %r", e)
        room = max(1, self.settings.max_waiting_jobs - len(self.pending))
        try:
            # Polling continues while paused: it keeps this member alive in the group
            # (max_poll_interval_ms) however long the engine works.
            batches = await kc.getmany(self.consumer, timeout_ms=100, max_records=room)
        except KafkaError as e:
            log.warning("poll failed: %r", e)
            await asyncio.sleep(0.2)
            return
        except Exception as e:  # noqa: BLE001 - aiokafka could not decode a record (header key not UTF-8)
            log.warning("poll: undecodable record (%r); dead-lettering it", e)
            await self._skip_undecodable()
            return
        await self._handle_records([(tp, rec) for tp, records in batches.items() for rec in records])

    async def _handle_records(self, records: list[tuple[TopicPartition, Any]]) -> None:
        """Decode and register each record; then tokenize the new jobs off the event loop. The
        poll loop waits for this, so one poll's work (at most ``max_waiting_jobs`` records) is
        done before the next fetch: the loop stays responsive and memory stays bounded."""
        fresh: list[JobState] = []
        # Decoded on a thread: a record the decoders refuse (valid JSON nested a million deep) is
        # scanned in pure Python, seconds for a few MB, which on the loop would stop heartbeats,
        # streams and probes for as long. One hop per poll, not per record.
        decoded = await asyncio.to_thread(lambda: [_decode(rec.value) for _, rec in records]) if records else []
        for (tp, rec), d in zip(records, decoded):
            try:
                st = self._on_record(tp, rec, d)
            except Exception:  # noqa: BLE001 - one record must never kill the worker
                log.exception("record %s/%s@%s failed", tp.topic, tp.partition, rec.offset)
                continue
            if st is not None:
                fresh.append(st)
        if fresh:
            for st, err in zip(fresh, await asyncio.to_thread(lambda: [self._safe_precheck(st) for st in fresh])):
                if err is None and getattr(st.params, "structured_outputs", None) is not None and hasattr(self.engine, "validate_structured"):
                    self._start_validation(st)  # its grammar compiles on a thread; it queues after
                else:
                    self._queue(st, err)
        if records:
            self._wake.set()

    async def _skip_undecodable(self) -> None:
        """aiokafka raises for a whole partition when one record's header key is not UTF-8.
        Read the raw records up to that one, handle the good ones, dead-letter the bad one and
        seek past it; otherwise the partition would never be answered again."""
        from qworker.worker.rawfetch import undecodable

        assert self.consumer is not None
        try:
            found = await undecodable(self.consumer, sorted(self.consumer.assignment(), key=lambda tp: (tp.topic, tp.partition)))
        except KafkaError as e:
            log.warning("raw fetch failed: %r", e)
            await asyncio.sleep(0.2)
            return
        if not found:
            await asyncio.sleep(0.2)
            return
        for tp, recs in found.items():
            *good, bad = recs
            await self._handle_records([(tp, r) for r in good])
            if tp in self.consumer.assignment() and self.tracker.add(tp, bad.offset):
                self.stats.records += 1
                keys = ", ".join(k.hex() for k, _ in bad.raw_headers if not _utf8(k))
                headers = [raw_headers_header(bad.raw_headers)] + dlq_headers("bad_headers", f"header key(s) not UTF-8 (hex): {keys}", tp.topic, tp.partition, bad.offset, bad.timestamp)
                self.stats.dlq += 1
                tele = self._job_telemetry("", tp, bad, time.time(), headers=None)
                self._publish_side(self.settings.dlq_topic, bad.key, bad.value, headers, [(tp, bad.offset)], tele, ("dlq", "bad_headers"))
            self.consumer.seek(tp, bad.offset + 1)

    def _on_record(self, tp: TopicPartition, rec: Any, d: Decoded | Exception) -> JobState | None:
        """Answer at once what can be answered without the tokenizer; returns a new job (already
        registered in ``self.jobs``, so duplicates and cancels find it) that needs ``_precheck``."""
        if tp not in self.consumer.assignment():
            return None  # revoked while this batch was being handled
        if not self.tracker.add(tp, rec.offset):
            self.stats.refetched += 1
            return None
        self.stats.records += 1
        now = time.time()
        if isinstance(d, Exception):
            raise d
        if isinstance(d, Unparseable):
            # the original key, value and headers byte for byte (null stays null), then ours
            headers = with_original(rec.headers, dlq_headers(d.code, d.message, tp.topic, tp.partition, rec.offset, rec.timestamp))
            self.stats.dlq += 1
            tele = self._job_telemetry("", tp, rec, now)
            self._publish_side(self.settings.dlq_topic, rec.key, rec.value, headers, [(tp, rec.offset)], tele, ("dlq", d.code))
            return None
        if isinstance(d, Invalid):
            self.stats.errors += 1
            msg = error_message(d.job_id, d.code, d.message, retryable=False, metadata=d.metadata, attempt=self.attempts.next(d.job_id, self.generation))
            tele = self._job_telemetry(d.job_id, tp, rec, now)
            headers = answer_headers(msg, d.wire)
            data = self._encode(msg, headers, answer_shape(d.wire, self.token_text, d.param))
            if d.dead_letter:  # answered, and also kept byte for byte for an operator (best effort: the answer moves the offset)
                copy = with_original(rec.headers, dlq_headers(d.dead_letter, d.message, tp.topic, tp.partition, rec.offset, rec.timestamp))
                self._publish_side(self.settings.dlq_topic, rec.key, rec.value, copy, [])
            self._publish_side(self.settings.completions_topic, d.job_id, data, headers or None, [(tp, rec.offset)], tele, ("error", d.code))
            return None
        assert isinstance(d, Valid)
        job = d.job
        holder = self.jobs.get(job.id)
        if holder is not None:
            holder.waiters.append((tp, rec.offset))
            self.stats.duplicates += 1
            return None
        ts = rec.timestamp / 1000 if rec.timestamp and rec.timestamp > 0 else now
        st = JobState(job=job, tp=tp, offset=rec.offset, produced_at=min(ts, now), received_at=now, wire=d.wire)
        st.attempt = self.attempts.next(job.id, self.generation)
        st.tele = self._job_telemetry(job.id, tp, rec, now)
        if job.id in self.cancels:
            self._finish_now(st, cancelled_completion(st, self.model_name))
            return None
        err = self._quick_check(st)
        if err is not None:
            self._finish_now(st, err)
            return None
        self.jobs[job.id] = st
        return st

    def _start_validation(self, st: JobState) -> None:
        """A job with a structured-output spec: compile (or find cached) its grammar on a worker
        thread, then queue it, or answer it with ``invalid_structured_output`` before it takes
        any engine time. One task per job, so a slow compile holds up no other job (nor the poll
        loop, which does not wait for it)."""
        task = asyncio.create_task(self._validate_structured(st), name=f"validate:{st.job.id}")
        self._validating[task] = st
        task.add_done_callback(lambda t: self._validating.pop(t, None))

    async def _validate_structured(self, st: JobState) -> None:
        from qworker.engine.sampling_params import InvalidRequestError

        err = None
        try:
            await self.engine.validate_structured(st.params)
            st.structured_validated = True
        except InvalidRequestError as e:
            err = error_message(st, e.code, str(e), retryable=False)
        except Exception as e:  # noqa: BLE001 - the job must be answered, not dropped
            # not the spec's fault (the compiler refuses a spec with InvalidRequestError): retryable
            err = error_message(st, "engine_error", f"{type(e).__name__}: {e}"[:2000], retryable=True)
        self._queue(st, err)
        if self._wake is not None:
            self._wake.set()

    def _queue(self, st: JobState, err: BaseModel | None) -> None:
        """After tokenizing: queue the job, or answer it. It may have been abandoned (revoke)
        or cancelled meanwhile."""
        if self.jobs.get(st.job.id) is not st:
            return  # abandoned while tokenizing: the partition's new owner answers it
        if err is None and st.job.id in self.cancels:
            err = cancelled_completion(st, self.model_name)
        if err is not None:
            self._forget(st)
            self._finish_now(st, err)
            return
        self.pending.push(st.job.priority, st)
        st.tele.queued()

    def _job_telemetry(self, job_id: str, tp: TopicPartition, rec: Any, received_at: float, headers: Any = ...) -> JobTelemetry:
        assert self.telemetry is not None
        return self.telemetry.job(job_id, tp.topic, tp.partition, rec.offset, rec.key, rec.headers if headers is ... else headers, received_at)

    def _quick_check(self, st: JobState) -> BaseModel | None:
        job = st.job
        if job.model is not None and job.model not in self.model_names:
            return error_message(st, "wrong_model", f"this worker serves {self.model_name!r}, not {job.model!r}", retryable=False)
        if job.deadline is not None and time.time() > job.deadline:
            return error_message(st, "deadline_exceeded", f"deadline {job.deadline} passed before the job started", retryable=False)
        return None

    def _safe_precheck(self, st: JobState) -> BaseModel | None:
        """``_precheck`` that answers instead of raising: one poll's jobs are checked in one call,
        and an exception there would strand all of them (unanswered, their offsets pinned)."""
        try:
            return self._precheck(st)
        except Exception as e:  # noqa: BLE001 - every job must be answered
            log.exception("precheck failed", extra=log_fields(st))
            return error_message(st, "internal_error", f"{type(e).__name__}: {e}"[:2000], retryable=True)

    def _precheck(self, st: JobState) -> BaseModel | None:
        """Reject what can never run. Fills ``prompt_ids`` and ``params``. Runs in a worker
        thread (tokenizing a 4 MB prompt takes seconds): it touches only ``st`` and the
        engine's thread-safe tokenizer, checks and capacity snapshot."""
        from qworker.engine.sampling_params import InvalidRequestError, SamplingParams

        from qworker.engine.structured.spec import from_response_format

        job = st.job
        try:
            st.params = SamplingParams(**job.sampling.engine_kwargs(), structured_outputs=from_response_format(job.response_format))
            st.prompt_ids = list(self.engine.encode(job.prompt_input()))
            self.engine.check(st.prompt_ids, st.params)
        except InvalidRequestError as e:
            return error_message(st, e.code, str(e), retryable=False)
        except Exception as e:  # noqa: BLE001 - e.g. the tokenizer choking on odd input
            return error_message(st, "invalid_prompt", f"{type(e).__name__}: {e}"[:2000], retryable=False)
        total = getattr(self.engine.capacity(), "total_tokens", None)
        if total is not None and st.prompt_len + 1 > total:
            return error_message(st, "prompt_too_long", f"prompt has {st.prompt_len} tokens; the KV cache holds {total}", retryable=False)
        return None

    # ------------------------------------------------------------------ admission and runs
    async def _admit_loop(self) -> None:
        assert self._wake is not None
        while True:
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await self._wake.wait()
            self._wake.clear()
            if not self.draining:
                try:
                    self._admit()
                except Exception:  # noqa: BLE001 - the admission loop must outlive any one job
                    log.exception("admission pass failed")

    def _admit(self) -> None:
        while len(self.pending):
            st = self.pending.peek()
            assert st is not None
            if st.job.deadline is not None and time.time() > st.job.deadline:
                self.pending.pop()
                self._forget(st)
                self._finish_now(st, error_message(st, "deadline_exceeded", f"deadline {st.job.deadline} passed while queued", retryable=False))
                continue
            running = [j for j in self.jobs.values() if j.admitted]
            if not self.admission.can_admit(st, self.engine.capacity(), running):
                break
            self.pending.pop()
            st.new_run(self.attempts.next(st.job.id, self.generation))
            st.task = asyncio.create_task(self._run(st), name=f"job:{st.job.id}")

    async def _run(self, st: JobState) -> None:
        """Invariant: the run ends with exactly one published answer (completion or error) and
        its records marked done, or, when abandoned, with nothing published and its records
        left uncommitted for the partition's next owner."""
        topic = self.settings.completions_topic
        try:
            try:
                result: BaseModel = await self.runner.run(st)
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
                result = await self._deliver_answer(topic, st.job.id, result, headers or None, answer_shape(st.wire, self.token_text))
        except (asyncio.CancelledError, DeliveryAborted):
            # Abandoned (revoke, drain timeout): no completion, offsets stay uncommitted, the
            # partition's next owner reruns the job with a higher attempt.
            self.stats.abandoned += 1
            self._forget(st)
            st.tele.outcome("abandoned")
            return
        except DeliveryRefused as e:
            # Nothing can be published for it (e.g. not authorised for the topic): leave its
            # records uncommitted rather than commit past an unanswered job; an operator must act.
            log.error("no answer can be published: %s", e, extra=log_fields(st))
            self._forget(st)
            st.tele.outcome("error", "undeliverable")
            return
        self._count(result)
        self._done(st)
        st.tele.outcome(*_outcome(result), partition=st.tp.partition, offset=st.offset, output_tokens=st.generated)

    def _encode(self, msg: BaseModel, headers: list | None = None, shape: Shape = dumps) -> bytes:
        return self._encoded(msg, headers, shape)[1]

    def _encoded(self, msg: BaseModel, headers: list | None = None, shape: Shape = dumps) -> tuple[BaseModel, bytes]:
        """The answer's bytes in the job's format (``shape``), never unsendable: a result that
        cannot be serialised or exceeds ``max_message_bytes`` is replaced by a small error saying
        so (``internal_error`` / ``result_too_large`` with both sizes), whose metadata is dropped
        if even that is too big. The limit applies to the shaped bytes, which are what goes out."""
        key = getattr(msg, "job_id", "")
        limit = self.settings.max_message_bytes - _HEADER_ROOM
        try:
            data = shape(msg)
        except Exception as e:  # noqa: BLE001 - e.g. metadata pydantic cannot serialise
            msg, data = self._replace(msg, "internal_error", f"could not serialise the result: {type(e).__name__}: {e}"[:2000]), b""
        else:
            size = record_size(key, data, headers)
            if size <= limit:
                return msg, data
            msg = self._replace(msg, "result_too_large", f"the result is {size} bytes; the limit (max_message_bytes) is {self.settings.max_message_bytes}")
        try:
            data = shape(msg)
        except Exception:  # noqa: BLE001
            data = b""
        if not data or record_size(key, data, headers) > limit:
            assert isinstance(msg, JobError)
            msg = msg.model_copy(update={"metadata": None})
            data = shape(msg)
        return msg, data

    @staticmethod
    def _replace(msg: BaseModel, code: str, message: str) -> JobError:
        info = {"code": code, "message": message, "retryable": False}
        return JobError.model_validate({"job_id": getattr(msg, "job_id", ""), "attempt": getattr(msg, "attempt", 0), "run_id": getattr(msg, "run_id", ""), "error": info, "metadata": getattr(msg, "metadata", None)})

    async def _deliver_answer(self, topic: str, key: str, msg: BaseModel, headers: list | None, shape: Shape = dumps) -> BaseModel:
        """Deliver a final answer; returns what was published (an error may replace it)."""
        assert self.publisher is not None
        msg, data = self._encoded(msg, headers, shape)
        try:
            await self.publisher.deliver(topic, key, data, headers)
        except DeliveryRefused as e:  # e.g. a broker limit below ours: answer with a small error
            if not e.too_large:
                raise
            small = self._replace(msg, "result_too_large", f"the broker refused the result: {e}"[:2000])
            small = small.model_copy(update={"metadata": None})
            await self.publisher.deliver(topic, key, shape(small), headers)
            return small
        return msg

    def _count(self, msg: BaseModel) -> None:
        if isinstance(msg, Completion):
            if msg.status == "cancelled":
                self.stats.cancelled += 1
            else:
                self.stats.completed += 1
        else:
            self.stats.errors += 1

    def _done(self, st: JobState) -> None:
        """The job's result is acknowledged: its records may be committed past."""
        for tp, off in st.offsets():
            self.tracker.done(tp, off)
        self._forget(st)

    def _forget(self, st: JobState) -> None:
        if self.jobs.get(st.job.id) is st:
            del self.jobs[st.job.id]
        if self._wake is not None:
            self._wake.set()

    def _finish_now(self, st: JobState, msg: BaseModel) -> None:
        """Publish an immediate answer (error or early cancel) for a job that never runs."""
        headers = answer_headers(msg, st.wire)
        msg, data = self._encoded(msg, headers, answer_shape(st.wire, self.token_text))
        self._count(msg)
        self._publish_side(self.settings.completions_topic, st.job.id, data, headers or None, st.offsets(), st.tele, _outcome(msg))

    def _publish_side(
        self,
        topic: str,
        key: bytes | str | None,
        value: bytes | None,
        headers: list | None,
        offsets: list[tuple[TopicPartition, int]],
        tele: JobTelemetry | None = None,
        outcome: tuple[str, str | None] | None = None,
    ) -> None:
        """Publish in the background; once acknowledged, mark ``offsets`` done and record the
        job's ``outcome`` (outcome, error code) on ``tele``. ``key`` and ``value`` go out as
        given (a DLQ copy keeps the original bytes, None included)."""

        async def go() -> None:
            try:
                if tele is None or topic == self.settings.dlq_topic:
                    # a DLQ copy keeps the original headers as they were (no traceparent swap)
                    await self.publisher.deliver(topic, key, value, headers)
                else:
                    with tele.publish(topic, headers) as h:
                        await self.publisher.deliver(topic, key, value, h or None)
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
                # only a DLQ copy can be too large (answers are bounded): retrying would pin the
                # partition, and the record cannot be answered anyway; log loudly and move on
                log.error("%s refused the record for %s: %s; committing past it", topic, offsets, e, extra=tele.log_fields() if tele is not None else None)
            for tp, off in offsets:
                self.tracker.done(tp, off)
            if tele is not None and outcome is not None:
                tele.outcome(*outcome, partition=offsets[0][0].partition, offset=offsets[0][1])

        t = asyncio.create_task(go())
        self._side.add(t)
        t.add_done_callback(self._side.discard)

    # ------------------------------------------------------------------ cancellation
    async def cancel(self, job_id: str, made_at: float | None = None) -> None:
        """A cancel request made at Unix time ``made_at``: abort the job if we hold it;
        remember it (for ``cancel_ttl_s`` from ``made_at``) in case the job arrives later."""
        if not self.cancels.add(job_id, made_at):
            return  # older than the TTL: a pod that read it in time would have forgotten it too
        st = self.jobs.get(job_id)
        if st is None:
            return
        if not st.admitted:
            if self.pending.remove(st):
                self._forget(st)
                self._finish_now(st, cancelled_completion(st, self.model_name))
            return  # still tokenizing: ``_queue`` sees the cancel in the registry
        st.cancel_requested = True
        # Before the run called generate() the engine does not know the id: the runner sees
        # the flag and answers "cancelled" without starting. After it, commands reach the
        # engine thread in order, so this abort follows the request's "add".
        if st.in_engine and not st.gen_done:
            await self.engine.abort(st.request_id)

    # ------------------------------------------------------------------ rebalance
    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit what is done before ownership may move. Jobs keep running until we learn, in
        ``_on_assigned``, which partitions actually moved (an eager rebalance revokes all)."""
        self.stats.rebalances += 1
        self._revoked |= revoked
        c, f = await kc.commit(self.consumer, self.tracker, list(revoked))
        self.stats.commits += c
        self.stats.commit_failures += f

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        self.generation = kc.generation(self.consumer)
        self.joined = True
        lost = (self._revoked | set(self.tracker.partitions())) - assigned
        self._revoked = set()
        if lost:
            self._abandon(lost)
        await self._check_kept(assigned)
        if self.pauser is not None and self.pauser.paused:
            self.consumer.pause(*assigned)  # a rebalance clears pauses
        log.info("assigned %s (generation %d)", sorted(f"{tp.topic}/{tp.partition}" for tp in assigned), self.generation)

    async def _check_kept(self, assigned: set[TopicPartition]) -> None:
        """A kept partition whose group offset is now below the one we committed (or gone) no
        longer holds the records we saw: the broker lost its data (a topic re-created, a log
        truncated by an unclean election, memory storage restarted) or an operator reset the
        group's offsets. Its new records reuse offsets we already saw; keeping our "seen up to"
        mark would take them for refetches and never answer them. So the partition starts
        afresh; its in-flight jobs still answer, but no longer mark offsets of the new log."""
        # One deadline for all of them: a stalled broker must not hold up the rebalance (5 s per
        # partition, one after the other, was 40 s for 8 partitions). Unchecked ones stay as they are.
        deadline = asyncio.get_running_loop().time() + KEPT_CHECK_TIMEOUT_S
        for tp in sorted(assigned & set(self.tracker.partitions()), key=lambda t: t.partition):
            ours = self.tracker.last_committed(tp)
            if ours is None:
                continue
            try:
                async with asyncio.timeout_at(deadline):
                    theirs = await self.consumer.committed(tp)
            except (KafkaError, TimeoutError) as e:
                log.debug("committed(%s) failed: %r", tp, e)
                continue
            if theirs is not None and theirs >= ours:
                continue
            log.warning("%s/%d: the group's offset is %s, below the %d we committed: the log was reset; starting the partition afresh", tp.topic, tp.partition, theirs, ours)
            for st in self.jobs.values():
                st.waiters = [w for w in st.waiters if w[0] != tp]
                if st.tp == tp:
                    st.tp = _DETACHED
            self.tracker.drop(tp)

    def _abandon(self, lost: set[TopicPartition]) -> None:
        """Abort the lost partitions' unfinished jobs without committing them: the new owner
        reruns them. A queued job whose waiters sit on partitions we keep is requeued for them.
        A *running* job with such waiters keeps running and answers them: aborting it could
        race its delivery (the completion already acknowledged) and run it a second time here."""
        for st in list(self.jobs.values()):
            st.waiters = [w for w in st.waiters if w[0] not in lost]
            if st.tp not in lost:
                continue
            if st.admitted and st.waiters:
                continue  # its record on the lost partition is the new owner's; done() ignores it
            if st.admitted:
                st.task.cancel()  # its run records the outcome
            else:
                self.pending.remove(st)
                st.tele.outcome("abandoned")
            self._forget(st)
            if st.waiters:
                (tp, off), rest = st.waiters[0], st.waiters[1:]
                heir = JobState(job=st.job, tp=tp, offset=off, produced_at=st.produced_at, received_at=st.received_at, waiters=rest, prompt_ids=st.prompt_ids, params=st.params,
                                wire=st.wire)
                heir.attempt = self.attempts.next(st.job.id, self.generation)  # for an answer before its run
                assert self.telemetry is not None
                heir.tele = self.telemetry.job(st.job.id, tp.topic, tp.partition, off, st.job.id, None, st.received_at)
                self.jobs[st.job.id] = heir
                # still tokenizing when abandoned: the heir tokenizes here (rare: a duplicate on
                # another partition during a revoke)
                self._queue(heir, self._precheck(heir) if st.params is None else None)
        for tp in lost:
            self.tracker.drop(tp)

    # ------------------------------------------------------------------ commits
    async def _commit_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.settings.commit_interval_ms / 1000)
            try:
                await self._commit()
                self._observe()
            except Exception:  # noqa: BLE001 - offsets must keep moving whatever one round hit
                log.exception("commit round failed")

    async def _commit(self) -> None:
        assigned = self.consumer.assignment()
        c, f = await kc.commit(self.consumer, self.tracker, [tp for tp in self.tracker.partitions() if tp in assigned])
        self.stats.commits += c
        self.stats.commit_failures += f

    # ------------------------------------------------------------------ probes and metrics
    def _busy(self) -> bool:
        """Work is in flight: only then does a stale engine stamp mean a stuck engine."""
        return any(st.admitted for st in self.jobs.values())

    def _observe(self) -> None:
        """Hands the loop-owned state to the metrics (scrapes run on another thread): consumer
        lag per owned partition (high watermark from the last fetch, which Tansu reports right,
        minus the offset we would commit) and the worker's own counters and gauges."""
        if self.metrics is None:
            return
        owned: set[tuple[str, int]] = set()
        if self.consumer is not None:
            for tp in self.consumer.assignment():
                owned.add((tp.topic, tp.partition))
                hw, c = self.consumer.highwater(tp), self.tracker.committable(tp)
                if hw is not None and c is not None:
                    self.metrics.set_consumer_lag(tp.topic, tp.partition, hw - c)
        self.metrics.retain_consumer_lag(owned)
        # job outcomes are counted by qworker:jobs_total{outcome}; these are the rest
        counters = {k: v for k, v in asdict(self.stats).items() if k not in ("completed", "cancelled", "errors", "dlq", "abandoned")}
        self.metrics.update_worker(counters, self.gauges())

    def gauges(self) -> dict[str, float]:
        g: dict[str, float] = {
            "pending_jobs": len(self.pending),
            "running_jobs": sum(1 for st in self.jobs.values() if st.admitted),
            "paused": float(bool(self.pauser and self.pauser.paused)),
            "unfinished_offsets": self.tracker.num_pending(),
        }
        if self.consumer is not None:
            g["assigned_partitions"] = len(self.consumer.assignment())
        if self.engine is not None and self.ready:
            cap = self.engine.capacity()
            g.update(kv_free_tokens=cap.free_tokens, kv_total_tokens=cap.total_tokens, engine_running=cap.num_running, engine_waiting=cap.num_waiting)
        return g


def _outcome(msg: BaseModel) -> tuple[str, str | None]:
    """(outcome, error code) of a final message, for the jobs counter and the job's span."""
    if isinstance(msg, Completion):
        return ("cancelled", None) if msg.status == "cancelled" else ("completed", None)
    return "error", getattr(getattr(msg, "error", None), "code", None)


async def serve(settings: WorkerSettings, engine: Any | None = None) -> int:
    """Run a worker until SIGTERM/SIGINT, then drain. Returns the exit status."""
    from qworker.worker import shutdown

    w = Worker(settings, engine)
    shutdown.install(asyncio.get_running_loop(), w.request_stop, w.hurry)
    try:
        await w.start()
    except BaseException:
        # close what did start (probe server, producer, engine) before the error is reported
        await w.close_after_failed_start()
        raise
    await w.wait_stop_requested()
    await w.stop()
    return 0


def _decode(value: bytes | None) -> Decoded | Exception:
    """``decode``, its failure (a bug) kept for the record it belongs to."""
    try:
        return decode(value)
    except Exception as e:  # noqa: BLE001 - one record must never lose the others of its poll
        return e


def _utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
