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
from aiokafka.errors import KafkaError

from qworker.config import WorkerSettings
from pydantic import BaseModel

from qworker.messages import Completion, dumps
from qworker.worker import consumer as kc
from qworker.worker.admission import Admission, PendingQueue
from qworker.worker.cancellation import CancelRegistry, CancelWatcher
from qworker.worker.decode import Invalid, Unparseable, Valid, decode
from qworker.worker.dlq import dlq_headers
from qworker.worker.jobs import JobRunner, JobState, cancelled_completion, error_message
from qworker.worker.offsets import OffsetTracker
from qworker.worker.publisher import DeliveryAborted, Publisher
from qworker.worker.stats import WorkerStats
from qworker.telemetry import EngineLiveness, TelemetryServer, Tracing, WorkerMetrics, configure_tracing
from qworker.telemetry.job import JobTelemetry, Telemetry

log = logging.getLogger("qworker.worker")


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
        self.model_names: set[str] = set()
        self.model_name = ""
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None
        self.pauser: kc.Pauser | None = None
        self.http: TelemetryServer | None = None
        self.metrics: WorkerMetrics | None = None
        self.telemetry: Telemetry | None = None
        self.warmed_up = False
        self.joined = False  # the consumer joined its group (it may own no partition)
        self._cancel_watcher: CancelWatcher | None = None
        self._side: set[asyncio.Task] = set()  # DLQ/error/cancel publications
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
        tracing = self._tracing or configure_tracing()
        name = s.model_name or (self.engine.model_name if self.engine is not None else os.path.basename(os.path.normpath(s.model or "model")))
        self.metrics = WorkerMetrics(name)
        if s.http_port >= 0:
            # up before the model loads, so a startup probe sees a live process
            self.http = TelemetryServer(
                s.http_host,
                s.http_port,
                metrics=self.metrics,
                liveness={"engine_loop": EngineLiveness(lambda: self.engine, s.liveness_timeout_s, busy=self._busy)},
                readiness={
                    "model_loaded": lambda: self.engine is not None and bool(getattr(self.engine, "ready", False)),
                    "warmed_up": lambda: self.warmed_up,
                    "in_group": lambda: self.joined,
                    "not_draining": lambda: not self.draining,
                },
            )
            await self.http.start()
        if self.engine is None:
            from qworker.engine import AsyncEngine

            if not s.model:
                raise ValueError("no model: set QWORKER_MODEL or --model")
            # in a thread: the probe server must keep answering while the weights load
            self.engine = await asyncio.to_thread(AsyncEngine.from_model, s.model, **s.engine_config())
            await self.engine.start()
        if hasattr(self.engine, "stats"):
            self.metrics.attach_engine(self.engine.stats)
        await self._warm_up()
        self.model_name = s.model_name or self.engine.model_name
        self.telemetry = Telemetry(tracing, self.metrics, group_id=s.group_id, model=self.model_name)
        self.model_names = {self.model_name, self.engine.model_name}
        if s.model:
            self.model_names.add(os.path.basename(os.path.normpath(s.model)))
        self.producer = AIOKafkaProducer(**s.producer_options())
        await self.producer.start()
        self.publisher = Publisher(self.producer, lambda: self.giving_up)
        self.runner = JobRunner(self.engine, self.publisher, s.tokens_topic, s.stream_interval_ms / 1000, self.model_name)
        self.consumer = AIOKafkaConsumer(**s.consumer_options())
        self.consumer.subscribe([s.jobs_topic], listener=kc.Listener(self._on_revoked, self._on_assigned))
        await self.consumer.start()
        self.pauser = kc.Pauser(self.consumer)
        self._cancel_watcher = CancelWatcher(s.cancel_topic, s.consumer_options(), self.cancel, s.cancel_ttl_s)
        await self._cancel_watcher.start()
        self._loops = [
            asyncio.create_task(self._poll_loop(), name="poll"),
            asyncio.create_task(self._admit_loop(), name="admit"),
            asyncio.create_task(self._commit_loop(), name="commit"),
        ]
        self.ready = True
        log.info("worker %s up: model %s, jobs %s, group %s", s.client_id, self.model_name, s.jobs_topic, s.group_id)

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
        assert self.consumer is not None and self.pauser is not None and self._wake is not None
        while not self._closed:
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
                batches = await self.consumer.getmany(timeout_ms=100, max_records=room)
            except KafkaError as e:
                log.warning("poll failed: %r", e)
                await asyncio.sleep(0.2)
                continue
            for tp, records in batches.items():
                for rec in records:
                    try:
                        self._on_record(tp, rec)
                    except Exception:  # noqa: BLE001 - one record must never kill the worker
                        log.exception("record %s/%s@%s failed", tp.topic, tp.partition, rec.offset)
            if batches:
                self._wake.set()

    def _on_record(self, tp: TopicPartition, rec: Any) -> None:
        if tp not in self.consumer.assignment():
            return  # revoked while this batch was being handled
        if not self.tracker.add(tp, rec.offset):
            self.stats.refetched += 1
            return
        self.stats.records += 1
        now = time.time()
        d = decode(rec.value)
        if isinstance(d, Unparseable):
            headers = dlq_headers(d.code, d.message, tp.topic, tp.partition, rec.offset, rec.timestamp)
            self.stats.dlq += 1
            tele = self._job_telemetry("", tp, rec, now)
            self._publish_side(self.settings.dlq_topic, rec.key, rec.value or b"", headers, [(tp, rec.offset)], tele, ("dlq", d.code))
            return
        if isinstance(d, Invalid):
            self.stats.errors += 1
            msg = error_message(d.job_id, "invalid_job", d.message, retryable=False, metadata=d.metadata, attempt=self.generation)
            tele = self._job_telemetry(d.job_id, tp, rec, now)
            self._publish_side(self.settings.completions_topic, d.job_id, dumps(msg), None, [(tp, rec.offset)], tele, ("error", "invalid_job"))
            return
        assert isinstance(d, Valid)
        job = d.job
        holder = self.jobs.get(job.id)
        if holder is not None:
            holder.waiters.append((tp, rec.offset))
            self.stats.duplicates += 1
            return
        ts = rec.timestamp / 1000 if rec.timestamp and rec.timestamp > 0 else now
        st = JobState(job=job, tp=tp, offset=rec.offset, produced_at=min(ts, now), received_at=now)
        st.attempt = self.generation
        st.tele = self._job_telemetry(job.id, tp, rec, now)
        if job.id in self.cancels:
            self._finish_now(st, cancelled_completion(st, self.model_name))
            return
        err = self._precheck(st)
        if err is not None:
            self._finish_now(st, err)
            return
        self.jobs[job.id] = st
        self.pending.push(job.priority, st)
        st.tele.queued()

    def _job_telemetry(self, job_id: str, tp: TopicPartition, rec: Any, received_at: float) -> JobTelemetry:
        assert self.telemetry is not None
        return self.telemetry.job(job_id, tp.topic, tp.partition, rec.offset, rec.key, rec.headers, received_at)

    def _precheck(self, st: JobState) -> BaseModel | None:
        """Reject at once what can never run. Fills ``prompt_ids`` and ``params``."""
        from qworker.engine.sampling_params import InvalidRequestError, SamplingParams

        job = st.job
        if job.model is not None and job.model not in self.model_names:
            return error_message(st, "wrong_model", f"this worker serves {self.model_name!r}, not {job.model!r}", retryable=False)
        if job.deadline is not None and time.time() > job.deadline:
            return error_message(st, "deadline_exceeded", f"deadline {job.deadline} passed before the job started", retryable=False)
        try:
            st.params = SamplingParams(**job.sampling.engine_kwargs())
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
            st.new_run(self.generation)
            st.task = asyncio.create_task(self._run(st), name=f"job:{st.job.id}")

    async def _run(self, st: JobState) -> None:
        try:
            result = await self.runner.run(st)
            with st.tele.publish(self.settings.completions_topic) as headers:
                await self.publisher.deliver(self.settings.completions_topic, st.job.id, dumps(result), headers or None)
        except (asyncio.CancelledError, DeliveryAborted):
            # Abandoned (revoke, drain timeout): no completion, offsets stay uncommitted, the
            # partition's next owner reruns the job with a higher attempt.
            self.stats.abandoned += 1
            self._forget(st)
            st.tele.outcome("abandoned")
            return
        except Exception:  # noqa: BLE001
            log.exception("job %s: unexpected failure", st.job.id)
            self._forget(st)
            st.tele.outcome("error", "internal")
            return
        self._count(result)
        self._done(st)
        st.tele.outcome(*_outcome(result), partition=st.tp.partition, offset=st.offset, output_tokens=st.generated)

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
        self._count(msg)
        self._publish_side(self.settings.completions_topic, st.job.id, dumps(msg), None, st.offsets(), st.tele, _outcome(msg))

    def _publish_side(
        self,
        topic: str,
        key: bytes | str | None,
        value: bytes,
        headers: list | None,
        offsets: list[tuple[TopicPartition, int]],
        tele: JobTelemetry | None = None,
        outcome: tuple[str, str | None] | None = None,
    ) -> None:
        """Publish in the background; once acknowledged, mark ``offsets`` done and record the
        job's ``outcome`` (outcome, error code) on ``tele``."""
        if isinstance(key, bytes):
            key = key.decode("utf-8", "replace")

        async def go() -> None:
            try:
                if tele is None:
                    await self.publisher.deliver(topic, key or "", value, headers)
                else:
                    with tele.publish(topic, headers) as h:
                        await self.publisher.deliver(topic, key or "", value, h or None)
            except DeliveryAborted:
                if tele is not None:
                    tele.outcome("abandoned")
                return  # stays uncommitted
            for tp, off in offsets:
                self.tracker.done(tp, off)
            if tele is not None and outcome is not None:
                tele.outcome(*outcome, partition=offsets[0][0].partition, offset=offsets[0][1])

        t = asyncio.create_task(go())
        self._side.add(t)
        t.add_done_callback(self._side.discard)

    # ------------------------------------------------------------------ cancellation
    async def cancel(self, job_id: str) -> None:
        """A cancel request: abort the job if we hold it; remember it in case it arrives later."""
        self.cancels.add(job_id)
        st = self.jobs.get(job_id)
        if st is None:
            return
        if not st.admitted:
            if self.pending.remove(st):
                self._forget(st)
                self._finish_now(st, cancelled_completion(st, self.model_name))
            return
        st.cancel_requested = True
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
        if self.pauser is not None and self.pauser.paused:
            self.consumer.pause(*assigned)  # a rebalance clears pauses
        log.info("assigned %s (generation %d)", sorted(f"{tp.topic}/{tp.partition}" for tp in assigned), self.generation)

    def _abandon(self, lost: set[TopicPartition]) -> None:
        """Abort the lost partitions' unfinished jobs without committing them: the new owner
        reruns them. A run whose waiters sit on partitions we keep is requeued for them."""
        for st in list(self.jobs.values()):
            st.waiters = [w for w in st.waiters if w[0] not in lost]
            if st.tp not in lost:
                continue
            if st.admitted:
                st.task.cancel()  # its run records the outcome
            else:
                self.pending.remove(st)
                st.tele.outcome("abandoned")
            self._forget(st)
            if st.waiters:
                (tp, off), rest = st.waiters[0], st.waiters[1:]
                heir = JobState(job=st.job, tp=tp, offset=off, produced_at=st.produced_at, received_at=st.received_at, waiters=rest, prompt_ids=st.prompt_ids, params=st.params)
                assert self.telemetry is not None
                heir.tele = self.telemetry.job(st.job.id, tp.topic, tp.partition, off, st.job.id, None, st.received_at)
                self.jobs[st.job.id] = heir
                self.pending.push(st.job.priority, heir)
                heir.tele.queued()
        for tp in lost:
            self.tracker.drop(tp)

    # ------------------------------------------------------------------ commits
    async def _commit_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.settings.commit_interval_ms / 1000)
            await self._commit()
            self._observe()

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
    await w.start()
    await w.wait_stop_requested()
    await w.stop()
    return 0
