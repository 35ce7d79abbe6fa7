"""The worker: jobs topic -> admission -> engine -> result topics, committing only what is done.

``Worker`` wires the collaborators below and runs the lifecycle (start, warm-up, drain, stop,
probes); each collaborator owns its own state. Flow of one job record (all on one asyncio loop,
so no state needs a lock):
1. ``Intake.poll_loop`` fetches it (partitions stay polled even while paused) and registers its
   offset as unfinished in the ``OffsetTracker`` that ``Partitions`` owns.
2. ``Intake`` decodes it: unparseable bytes go to the DLQ and a schema-invalid job, a wrong
   model or an unknown LoRA adapter (``Adapters``: names from the settings, never paths), a past
   deadline or a prompt that can never fit get an ``error`` message at once, both
   through ``Answers.publish_side``; a job whose id is already in the ``Registry`` is attached
   to that run as a waiter. A structured-output spec is compiled before the job queues.
3. Valid jobs wait in the ``Registry``'s bounded ``PendingQueue``; ``Runs.admit_loop`` hands
   them to the engine (``JobRunner``) while ``Admission`` sees KV capacity. A full queue pauses
   the partitions. A cancel (``CancelWatcher`` -> ``Runs.cancel``) answers or aborts it.
4. The run streams coalesced deltas (``stream``), then ``Answers.deliver`` publishes the
   completion within the size limit; once the broker has acknowledged everything, the record
   (and its waiters) are marked finished and ``Partitions.commit_loop`` may move the
   partition's committed offset past them. A rebalance (``Partitions.on_revoked`` /
   ``on_assigned``) abandons the lost partitions' jobs uncommitted. ``Gauges`` hands the state
   to the metrics after each commit round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError

from qworker.config import WorkerSettings
from qworker.producer import start_producer
from qworker.telemetry import EngineLiveness, TelemetryServer, Tracing, WorkerMetrics, configure_tracing
from qworker.telemetry.job import Telemetry
from qworker.telemetry.tracing import TracingConfigError
from qworker.worker import consumer as kc
from qworker.worker.adapters import Adapters, LoRAUnavailable, start_adapters
from qworker.worker.admission import Admission, PendingQueue
from qworker.worker.answers import Answers
from qworker.worker.cancellation import CancelRegistry, CancelWatcher
from qworker.worker.engine_start import EngineStartError, load_engine
from qworker.worker.gauges import Gauges
from qworker.worker.intake import Intake
from qworker.worker.jobs import Attempts, JobRunner, JobState
from qworker.worker.offsets import OffsetTracker
from qworker.worker.partitions import Partitions
from qworker.worker.publisher import Publisher
from qworker.worker.registry import Registry
from qworker.worker.runs import Runs
from qworker.worker.stats import WorkerStats
from qworker.worker.wire import IdText, token_text

log = logging.getLogger("qworker.worker")
_KAFKA_CLOSE_S = 20.0  # the longest the stop waits on the broker (the chart's grace period is drain + 30 s)


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
        self.admission = Admission(settings.max_waiting_jobs, settings.admission_reserve_tokens)
        self.cancels = CancelRegistry(settings.cancel_ttl_s)
        self.registry = Registry()
        self.partitions = Partitions(self)
        self.answers = Answers(self)
        self.intake = Intake(self)
        self.runs = Runs(self)
        self.gauges = Gauges(self)
        self.draining = False  # no new jobs; in-flight ones finish
        self.giving_up = False  # deliveries stop retrying; unfinished offsets stay uncommitted
        self.ready = False
        self.model_names: set[str] = set()
        self.model_name = ""
        self.adapters = Adapters(None, lambda path: path, "")  # the LoRA adapters served (none until start)
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None
        self.publisher: Publisher | None = None
        self.runner: JobRunner | None = None
        self.pauser: kc.Pauser | None = None
        self.http: TelemetryServer | None = None
        self.metrics: WorkerMetrics | None = None
        self.telemetry: Telemetry | None = None
        self.warmed_up = False
        self.token_text = IdText()  # token pieces for OpenAI logprobs: the tokenizer's once loaded
        self.group_health: kc.GroupHealth | None = None  # /readyz: the consumer's state as the broker confirms it
        self._cancel_watcher: CancelWatcher | None = None
        self._loops: list[asyncio.Task] = []
        self._stop_requested: asyncio.Event | None = None
        self.closed = False  # loops exit (besides being cancelled)
        self.exit_code = 0  # 1 once the engine failed for good (a dead tensor-parallel rank)

    # the collaborators' state, under the names the rest of the worker (and its tests) use
    @property
    def jobs(self) -> dict[str, JobState]:
        return self.registry.jobs

    @property
    def pending(self) -> PendingQueue[JobState]:
        return self.registry.pending

    @property
    def attempts(self) -> Attempts:
        return self.registry.attempts

    @property
    def tracker(self) -> OffsetTracker[TopicPartition]:
        return self.partitions.tracker

    @property
    def generation(self) -> int:
        return self.partitions.generation

    @property
    def joined(self) -> bool:
        return self.partitions.joined

    async def cancel(self, job_id: str, made_at: float | None = None) -> None:
        await self.runs.cancel(job_id, made_at)

    async def start(self) -> None:
        s = self.settings
        self.registry.wake, self._stop_requested = asyncio.Event(), asyncio.Event()
        # tracing first: a bad OTEL_* setting fails the start before the model loads
        try:
            tracing = self._tracing or configure_tracing()
        except TracingConfigError as e:  # one line naming the OTEL_* variable, exit 2
            raise StartupError(str(e)) from e
        name = s.model_name or (self.engine.model_name if self.engine is not None else os.path.basename(os.path.normpath(s.model or "model")))
        self.metrics = WorkerMetrics(name)
        if s.http_port >= 0:
            # up before the model loads: /healthz answers while it loads, /startupz once it has
            self.http = TelemetryServer(
                s.http_host,
                s.http_port,
                metrics=self.metrics,
                liveness={
                    "engine_loop": EngineLiveness(lambda: self.engine, s.liveness_timeout_s, busy=self.registry.busy),
                    "worker_loops": self.loops_alive,
                    # a dead tensor-parallel rank: the worker is exiting; red until it has
                    "engine_executors": lambda: getattr(self.engine, "fatal", None) is None,
                },
                startup={"model_loaded": self.model_loaded, "warmed_up": lambda: self.warmed_up},
                readiness={
                    "model_loaded": self.model_loaded,
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
        if hasattr(self.engine, "on_fatal"):
            loop = asyncio.get_running_loop()
            self.engine.on_fatal = lambda e: loop.call_soon_threadsafe(self._engine_failed, e)
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
        self.adapters = Adapters(None, lambda path: path, self.model_name, self.model_names)
        if s.lora_enabled:  # validated before joining: no job is refused for an adapter still loading
            try:
                self.adapters = await start_adapters(s.lora_modules, s.lora_root, self.engine, self.model_name, self.model_names)
            except LoRAUnavailable as e:
                raise StartupError(str(e)) from e
            log.info("LoRA: serving %d adapters (%s), %d refused", len(self.adapters.served), ", ".join(sorted(self.adapters.served)) or "none",
                     len(self.adapters.refused))
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
        self.consumer.subscribe([s.jobs_topic], listener=kc.Listener(self.partitions.on_revoked, self.partitions.on_assigned))
        kc.on_log_may_have_changed(self.consumer, self.tracker.suspect_all)
        await self._connect(self.consumer)
        self.pauser = kc.Pauser(self.consumer)
        self.group_health = kc.GroupHealth(self.consumer, TopicPartition(s.jobs_topic, 0), s.ready_timeout_s)
        self._cancel_watcher = CancelWatcher(s.cancel_topic, s.consumer_options(), self.cancel, s.cancel_ttl_s)
        await self._cancel_watcher.start()
        self._cancel_watcher.task.add_done_callback(self._loop_ended)
        self._loops = [
            asyncio.create_task(self.intake.poll_loop(), name="poll"),
            asyncio.create_task(self.runs.admit_loop(), name="admit"),
            asyncio.create_task(self.partitions.commit_loop(), name="commit"),
            asyncio.create_task(self.gauges.observe_loop(s.commit_interval_ms / 1000), name="gauges"),
            asyncio.create_task(self.group_health.run(), name="group-health"),
        ]
        if s.lora_enabled:
            self._loops.append(asyncio.create_task(self.adapters.reload_loop(s.lora_reload_interval_s, self.gauges.observe), name="lora-reload"))
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
        if self.closed:
            return True
        loops_ok = all(not t.done() for t in self._loops)
        return loops_ok and (self._cancel_watcher is None or self._cancel_watcher.alive())

    def model_loaded(self) -> bool:
        return self.engine is not None and bool(getattr(self.engine, "ready", False))

    def _loop_ended(self, t: asyncio.Task) -> None:
        if not self.closed and not t.cancelled():
            log.error("worker loop %s ended: %r; /healthz now fails", t.get_name(), t.exception())

    def _engine_failed(self, e: BaseException) -> None:
        """The engine can run nothing any more (a tensor-parallel rank died): give up on every job
        at once, uncommitted (a healthy pod redoes them), and exit non-zero."""
        log.error("engine failed: %s; giving up in-flight jobs uncommitted and exiting", e)
        self.exit_code = 1
        self.hurry()

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
            self.registry.forget(st)
            st.tele.outcome("abandoned")
        for task, st in list(self.intake.validating.items()):  # compiling its grammar: the same
            task.cancel()
            self.registry.forget(st)
            st.tele.outcome("abandoned")
        running = [st.task for st in self.jobs.values() if st.task is not None]
        busy = running + list(self.answers.side)
        log.info("draining: %d running jobs, %d publications", len(running), len(self.answers.side))
        if busy:
            done, not_done = await asyncio.wait(busy, timeout=max(0.0, timeout))
            if not_done:
                log.warning("drain timeout: aborting %d unfinished jobs (left uncommitted)", len(not_done))
                self.giving_up = True
                for t in not_done:
                    t.cancel()
                await asyncio.gather(*not_done, return_exceptions=True)
        self.giving_up = True
        self.closed = True
        for t in self._loops:
            t.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        # the broker's part of the stop shares one time limit: a broker that is gone or frozen
        # costs the unanswered jobs a rerun elsewhere (they stay uncommitted), never a stop
        # that does not end within the pod's grace period
        deadline = time.monotonic() + min(self.settings.request_timeout_ms / 1000, _KAFKA_CLOSE_S)
        if self.consumer is not None:
            await _bounded("the final commit", self.partitions.commit(), deadline)
        log.info("drain: committed; leaving the group")
        if self._cancel_watcher is not None:
            await _bounded("the cancel watcher's stop", self._cancel_watcher.stop(), deadline)
        if self.consumer is not None:
            await _bounded("leaving the group", self.consumer.stop(), deadline)  # LeaveGroup: partitions move at once
            self.partitions.joined = False
        if self.producer is not None:
            await _bounded("the producer's flush", self.producer.stop(), deadline)
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
        self.closed = True
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
        # a model whose context is shorter than the text still warms up (one token and the answer fit)
        prompt = self.engine.encode("warm-up")[:max(1, self.engine.max_model_len - 1)]
        async for _ in self.engine.generate("qworker-warm-up", prompt, params):
            pass
        self.warmed_up = True


async def _bounded(what: str, step: Any, deadline: float) -> None:
    """Awaits one step of the stop until ``deadline`` (at least half a second, so a live broker
    always gets its requests); a step that times out or fails is logged and left behind."""
    try:
        async with asyncio.timeout(max(0.5, deadline - time.monotonic())):
            await step
    except TimeoutError:
        log.warning("stop: %s did not finish in time (broker unreachable?); going on without it", what)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the stop itself is being cancelled
        # aiokafka's close cancels its own fetch tasks and can let that escape (a fetch asleep in
        # its retry back-off): not ours to propagate
        log.warning("stop: %s was cancelled inside the Kafka client; going on without it", what)
    except Exception as e:  # noqa: BLE001 - the rest of the stop (engine, telemetry) must still run
        log.warning("stop: %s failed: %r; going on without it", what, e)


def raise_open_file_limit() -> int:
    """Lift this process's soft limit on open files to its hard limit and return it. Container
    runtimes often set the soft limit to 1,024, which a burst of probe connections or many
    brokers' connections can reach; the hard limit is what the operator allowed."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20  # Linux's default nr_open
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return soft


async def serve(settings: WorkerSettings, engine: Any | None = None) -> int:
    """Run a worker until SIGTERM/SIGINT, then drain. Returns the exit status."""
    from qworker.worker import shutdown

    raise_open_file_limit()
    w = Worker(settings, engine)

    def hurry() -> None:
        if w.consumer is None:
            # still starting (loading the model: a thread nothing can interrupt, for minutes on a
            # large one): nothing is joined, consumed or produced yet, so stop now
            log.warning("stopping at once: the worker had not joined its group")
            shutdown.exit_now(0)
        w.hurry()

    shutdown.install(asyncio.get_running_loop(), w.request_stop, hurry)
    try:
        await w.start()
    except BaseException:
        # close what did start (probe server, producer, engine) before the error is reported
        await w.close_after_failed_start()
        raise
    await w.wait_stop_requested()
    await w.stop(0.0 if w.exit_code else None)
    return w.exit_code
