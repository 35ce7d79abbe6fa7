"""One job's run on the engine: stream its tokens, build its completion or error."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from qworker.messages import Choice, Completion, ErrorInfo, Job, JobError, Timings, Usage, wire_logprob
from qworker.openai_batch.requests import OpenAIRequest
from qworker.telemetry.genai import CHAT, TEXT_COMPLETION
from qworker.telemetry.job import NULL_JOB
from qworker.worker.publisher import Publisher
from qworker.worker.stream import StreamCoalescer, StreamSender
from qworker.worker.wire import chunk_render


@dataclass(eq=False)
class JobState:
    """A fetched job. ``waiters`` are other records (offsets) carrying the same job id while it
    is in flight: they are answered by this run and committed with it, never run twice."""

    job: Job
    tp: Any  # TopicPartition
    offset: int
    produced_at: float  # the record's timestamp, seconds
    received_at: float
    waiters: list[tuple[Any, int]] = field(default_factory=list)
    # each waiter's record key and headers: an heir (see Partitions.abandon) continues its trace
    waiter_records: dict[tuple[Any, int], tuple[Any, Any]] = field(default_factory=dict)
    prompt_ids: list[int] = field(default_factory=list)
    params: Any = None  # engine SamplingParams
    structured_validated: bool = False  # its structured-output spec compiled at admission
    attempt: int = 0
    run_id: str = ""
    request_id: str = ""
    task: asyncio.Task | None = None
    cancel_requested: bool = False
    in_engine: bool = False  # generate() was called: the engine has (or is about to have) the request
    gen_done: bool = False  # the engine stream ended: a cancel can no longer change the result
    generated: int = 0
    tele: Any = NULL_JOB  # qworker.telemetry.job.JobTelemetry: spans, metrics, outcome log line
    wire: OpenAIRequest | None = None  # came as an OpenAI batch request line: answer in its shapes
    lora: Any = None  # engine LoRARequest the job runs under (None: the base model)
    # its record was in the log when this pod took the partition and this pod gave its id no answer
    # of the usual rank yet (Attempts.ranked): another pod may have answered it
    # (Partitions.maybe_answered_before); an answer without a run then ranks below that one (unstarted_answer)
    maybe_answered: bool = True

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.job.sampling.n * self.job.sampling.max_tokens

    @property
    def admitted(self) -> bool:
        return self.task is not None

    def model_name(self, base: str) -> str:
        """The name its answers carry: the adapter's, as a vLLM server answers, or the base's."""
        return self.lora.lora_name if self.lora is not None else base

    def offsets(self) -> list[tuple[Any, int]]:
        return [(self.tp, self.offset), *self.waiters]

    def new_run(self, attempt: int) -> None:
        self.attempt = attempt
        self.run_id = uuid.uuid4().hex[:16]
        # Unique per run: an aborted run of the same job may still be unwinding in the engine.
        self.request_id = f"{self.job.id}#{self.run_id}"
        self.in_engine = self.gen_done = self.cancel_requested = False


ATTEMPT_SPAN = 1000  # answers to one id one pod numbers apart within one generation


class Attempts:
    """The ``attempt`` of each answer: ``generation * ATTEMPT_SPAN + k``, where ``k`` counts the
    answers this worker gave the same job id earlier in the same group generation.

    So a later answer to an id always has a higher attempt: a rerun after a rebalance (a higher
    generation beats any ``k``), and a resubmission of an id that was already answered (the same
    generation, a higher ``k``). Within a generation only the owner of the id's partition answers
    it (records are keyed by job id), so counting here is enough. Bounded: the ``max_ids`` most
    recently answered ids are remembered; ``k`` stops growing at ``ATTEMPT_SPAN - 1``. An id
    that is not remembered may have been forgotten in this generation, so its ``k`` starts above
    every ``k`` forgotten in it (a resubmission after 65,536 other ids still gets a higher
    attempt than its first answer)."""

    def __init__(self, max_ids: int = 65_536):
        self.max_ids = max_ids
        self._last: OrderedDict[str, tuple[int, int]] = OrderedDict()  # job id -> (generation, k)
        self._forgotten = (-1, -1)  # (generation, the highest k forgotten in it)
        # ids this pod gave (or is giving) an answer of the usual rank: a run's, or any answer to a
        # record new since the take (see unstarted_answer); the max_ids most recent
        self._ranked: OrderedDict[str, None] = OrderedDict()

    def rank(self, job_id: str) -> None:
        """``job_id`` gets an answer of the usual rank here: a later record of it is a later
        answer here too (a resubmission), above, whatever was in the log at the take."""
        self._ranked.pop(job_id, None)
        self._ranked[job_id] = None
        if len(self._ranked) > self.max_ids:
            self._ranked.popitem(last=False)

    def ranked(self, job_id: str) -> bool:
        return job_id in self._ranked

    def next(self, job_id: str, generation: int) -> int:
        floor = self._forgotten[1] if self._forgotten[0] == generation else -1
        gen, k = self._last.pop(job_id, (generation, floor))
        k = min(k + 1, ATTEMPT_SPAN - 1) if gen == generation else 0
        self._last[job_id] = (generation, k)
        if len(self._last) > self.max_ids:
            _, (old_gen, old_k) = self._last.popitem(last=False)
            if old_gen == generation:
                self._forgotten = (generation, max(old_k, floor))
        return generation * ATTEMPT_SPAN + k


def log_fields(state: JobState) -> dict[str, str]:
    """``extra=`` for a log line about this job: its id (and trace id when it has one), so
    every per-job line names its job in either log format."""
    return {**state.tele.log_fields(), "job_id": state.job.id}


def error_message(state_or_id: JobState | str, code: str, message: str, retryable: bool, metadata: dict | None = None, attempt: int = 0, run_id: str = "") -> JobError:
    if isinstance(state_or_id, JobState):
        s = state_or_id
        return JobError(job_id=s.job.id, attempt=s.attempt, run_id=s.run_id, error=ErrorInfo(code=code, message=message, retryable=retryable), metadata=s.job.metadata)
    return JobError(job_id=state_or_id, attempt=attempt, run_id=run_id, error=ErrorInfo(code=code, message=message, retryable=retryable), metadata=metadata)


def unstarted_answer(state: JobState, msg: BaseModel) -> BaseModel:
    """``msg``, an answer given to ``state``'s record without a run (an error on arrival or while
    queued, a cancel before the run, a deadline the engine met first), ranked below every earlier
    answer (attempt 0) where the partition's previous owner may have answered the record
    (``state.maybe_answered``). Such a record comes again after a rebalance, by then past its
    deadline, its copies no longer attached to a run: its answer must not outrank the one already
    given. Where there was none, it is the only one; a record new since this pod took the
    partition (a resubmitted id's) keeps its attempt, above earlier answers."""
    return msg.model_copy(update={"attempt": 0}) if state.maybe_answered else msg


def cancelled_completion(state: JobState, model: str, now: float | None = None) -> Completion:
    """A job cancelled before it reached the engine."""
    now = time.time() if now is None else now
    n = state.job.sampling.n
    return Completion(
        job_id=state.job.id,
        attempt=state.attempt,
        run_id=state.run_id,
        status="cancelled",
        model=model,
        choices=[Choice(index=i, text="", token_ids=[], finish_reason="cancelled") for i in range(n)],
        usage=Usage(prompt_tokens=state.prompt_len, completion_tokens=0),
        timings=Timings(total_s=max(0.0, now - state.produced_at)),
        metadata=state.job.metadata,
    )


@dataclass(slots=True)
class _Acc:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[str, float]] | None = None


class JobRunner:
    """Runs a job on the engine. Returns the final message, or raises CancelledError /
    DeliveryAborted when the run is abandoned (revoke, drain timeout): then nothing is published
    and nothing committed. Engine failures become error messages; publishing problems are
    never mistaken for engine failures (a stalled broker only delays a healthy job)."""

    def __init__(self, engine: Any, publisher: Publisher, tokens_topic: str, stream_interval_s: float, model_name: str):
        self.engine, self.publisher = engine, publisher
        self.tokens_topic, self.interval_s, self.model_name = tokens_topic, stream_interval_s, model_name

    async def _tick(self, stream: StreamSender) -> None:
        # flushes the tail of a burst when no further token arrives for a while
        while True:
            await asyncio.sleep(self.interval_s)
            if stream.coalescer.due():
                await stream.flush()

    async def run(self, state: JobState) -> Completion | JobError:
        job = state.job
        tele = state.tele
        if state.cancel_requested:  # cancelled after admission, before the engine heard of it
            return cancelled_completion(state, state.model_name(self.model_name))
        accs = {i: _Acc() for i in range(job.sampling.n)}
        want_logprobs = job.sampling.logprobs is not None
        stream = None
        if job.stream:
            # one traceparent for every delta event of the run
            stream = StreamSender(self.publisher, self.tokens_topic, StreamCoalescer(job.id, state.attempt, state.run_id, self.interval_s), tele.stream_headers() or None,
                                  chunk_render(state.wire, state.model_name(self.model_name)), log_fields(state))
        tick = asyncio.create_task(self._tick(stream)) if stream is not None else None
        last = None
        cached = 0
        tele.generating(CHAT if job.messages is not None else TEXT_COMPLETION, job.sampling, stream=job.stream)
        # the engine checks the deadline when it would first schedule the request: a job that
        # waited in the engine's queue past it ends "abort" with error_code deadline_exceeded
        extra: dict[str, Any] = {"structured_validated": True} if state.structured_validated else {}
        if state.lora is not None:  # only then: an engine without LoRA never sees the argument
            extra["lora_request"] = state.lora
        gen = self.engine.generate(state.request_id, state.prompt_ids, state.params, priority=job.priority, deadline=job.deadline, **extra)
        state.in_engine = True  # from here a cancel must reach the engine (commands stay ordered)
        aborted = False
        try:
            while True:
                try:
                    out = await anext(gen)
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - a failed request must get an error, not silence
                    tele.failed(e)
                    code = getattr(e, "code", None)
                    if code:  # InvalidRequestError raised lazily by the engine
                        return error_message(state, code, str(e), retryable=False)
                    return error_message(state, "engine_error", f"{type(e).__name__}: {e}", retryable=True)
                tele.on_output(out)
                last = out
                cached = max(cached, out.num_cached_tokens or 0)
                for c in out.outputs:
                    acc = accs.setdefault(c.index, _Acc())
                    acc.text.append(c.text)
                    acc.token_ids.extend(c.token_ids)
                    state.generated += len(c.token_ids)
                    if c.finish_reason is not None:
                        acc.finish_reason = c.finish_reason
                    if want_logprobs and c.logprobs:
                        acc.logprobs = (acc.logprobs or []) + [{str(k): wire_logprob(v.logprob) for k, v in lp.items()} for lp in c.logprobs]
                    if stream is not None:
                        stream.coalescer.add(c.index, c.text, list(c.token_ids))
                if out.finished:
                    break
                if state.cancel_requested and not aborted:
                    # a cancel that raced the engine learning of the request: abort again (idempotent)
                    aborted = True
                    await self.engine.abort(state.request_id)
                if stream is not None and stream.coalescer.due():
                    await stream.flush()
        finally:
            state.gen_done = True
            await gen.aclose()  # aborts the request when it did not finish
            if tick is not None:
                res = await stream.stop_ticker(tick)
                if isinstance(res, Exception):
                    raise res  # a publishing failure in the ticker (stopping, refused)
        reasons = {a.finish_reason for a in accs.values()}
        last_seq: int | None = None
        # Cancelled only when the abort actually cut a choice short: a cancel that arrives after
        # the last token leaves a complete result, which stands (status and reasons agree).
        cut_short = bool(reasons & {None, "abort"})
        cancelled = state.cancel_requested and cut_short
        # the engine's error code where it ended the run (None for a cancel or a complete result)
        code = getattr(last, "error_code", None) if cut_short and not cancelled else None
        tele.generated(
            last,
            finish_reasons=[a.finish_reason or "abort" for _, a in sorted(accs.items())],
            input_tokens=state.prompt_len,
            output_tokens=sum(len(a.token_ids) for a in accs.values()),
            cached_tokens=cached,
            aborted="cancelled" if cancelled else None,
            error=code,
        )
        if stream is not None:
            if state.wire is not None and not cut_short:
                # OpenAI streams end each choice with its finish_reason (then the usage, if asked)
                usage = Usage(prompt_tokens=state.prompt_len, completion_tokens=sum(len(a.token_ids) for a in accs.values()), cached_tokens=cached)
                stream.coalescer.end({i: a.finish_reason for i, a in accs.items()}, usage if state.wire.include_usage else None)  # type: ignore[misc]
            # The stream must be complete before the completion is acknowledged and the offset moves.
            await stream.settle()
            state.run_id = stream.run_id  # a replayed stream has a fresh run id
            last_seq = stream.coalescer.last_seq
        if cut_short and not cancelled:
            err = getattr(last, "error", None)
            if code == "deadline_exceeded":
                return unstarted_answer(state, error_message(state, "deadline_exceeded",
                                                             err or f"deadline {job.deadline} passed before the engine started the job",
                                                             retryable=False))
            if code == "invalid_structured_output":  # its grammar failed in the engine (not validated at admission)
                return error_message(state, code, err or "the structured-output spec did not compile", retryable=False)
            if code == "invalid_lora":  # the engine could not load the job's adapter (its files changed since validation)
                return error_message(state, code, err or "the LoRA adapter did not load", retryable=False)
            return error_message(state, "engine_error", err or "the engine aborted the request", retryable=True)
        choices = [
            Choice(
                index=i,
                text="".join(a.text),
                token_ids=a.token_ids,
                finish_reason="cancelled" if cancelled and a.finish_reason in (None, "abort") else a.finish_reason,  # type: ignore[arg-type]
                logprobs=a.logprobs,
            )
            for i, a in sorted(accs.items())
        ]
        return Completion(
            job_id=job.id,
            attempt=state.attempt,
            run_id=state.run_id,
            status="cancelled" if cancelled else "ok",
            model=state.model_name(self.model_name),
            choices=choices,
            usage=Usage(prompt_tokens=state.prompt_len, completion_tokens=sum(len(c.token_ids) for c in choices), cached_tokens=cached),
            timings=timings(state, getattr(last, "metrics", None)),
            metadata=job.metadata,
            last_seq=last_seq,
        )


def timings(state: JobState, metrics: Any) -> Timings:
    t0 = state.produced_at

    def since(t: float | None) -> float | None:
        return None if t is None else max(0.0, t - t0)

    if metrics is None:
        return Timings(total_s=max(0.0, time.time() - t0))
    return Timings(
        queue_s=since(metrics.first_scheduled_time),
        ttft_s=since(metrics.first_token_time),
        total_s=since(metrics.finished_time) or max(0.0, time.time() - t0),
        num_preemptions=metrics.num_preemptions,
    )
