"""The synchronous engine: requests in, one ``step()`` at a time, updated requests out.

A step: schedule -> build the batch -> run the model -> fork n>1 requests whose prompt just
finished -> sample -> ``_update`` (the only place that mutates request state after a step).

Structured output: a request with ``params.structured_outputs`` has its grammar
compiled off this thread (``self.grammars``); until the compile is done it waits unscheduled (the
scheduler skips it, the rest of the queue goes on), then its first sequence gets a
``StructuredState``. Each step masks the constrained sampling rows (the fill overlaps the forward
pass) and ``_update`` advances each state by its sampled token; a terminated grammar finishes the
sequence with "stop". The state only moves in ``_update``, together with ``token_ids``, so a
failed step, a recompute or a swap leaves both consistent (nothing already generated is
re-sampled). A spec the compiler refuses (or a compile past ``grammar_compile_timeout``) finishes
the request, unscheduled, with ``error_code`` "invalid_structured_output".

Speculative decoding (``config.speculative_config``): before scheduling, each decoding
sequence gets an n-gram draft (``_propose``; cut where its grammar refuses a token, where it
would pass ``max_tokens`` or the context; ``auto`` may cap or drop the drafts of a step); the
scheduler gives it ``1 + len(draft)`` tokens and the model returns logits for each of them;
``spec_decode.verify`` samples each position in order as a plain step would and accepts the
draft tokens it reproduces. ``_update`` then appends the accepted tokens and the correction or
bonus token one at a time, with every stop rule applied to each (a stop inside the run cuts it
there), advances ``num_computed_tokens`` over the accepted ones only and trims the blocks of the
rejected ones. Nothing else changes: preemption, swap, forks, recovery and deadlines see an
ordinary decode whose step happened to produce several tokens.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from qworker.engine.config import EngineConfig
from qworker.engine.detokenizer import IncrementalDetokenizer
from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.outputs import ABORT, ERR_DEADLINE, ERR_ENGINE, LENGTH, STOP, RequestMetrics
from qworker.engine.sampler import sample
from qworker.engine.sampling_params import InvalidRequestError, SamplingParams
from qworker.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from qworker.engine.sequence import Request, SeqStatus, Sequence
from qworker.engine.spec_decode import AutoPolicy, NgramIndex, SpecDecodeStats
from qworker.engine.spec_decode.verify import verify
from qworker.engine.structured import GrammarCompilerService, StructuredBitmask, StructuredState, build_tokenizer_info
from qworker.engine.structured.spec import ERROR_CODE as ERR_STRUCTURED
from qworker.model.batch import Batch, SeqChunk
from qworker.model.runner import ModelRunner

log = logging.getLogger(__name__)

Prompt = str | list[int] | list[dict]


@dataclass(slots=True)
class Capacity:
    """What admission control needs: KV token slots not spoken for, and queue sizes."""

    free_tokens: int
    total_tokens: int
    block_size: int
    num_running: int
    num_waiting: int


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.runner = ModelRunner(config.model, config.device, config.dtype, config.max_model_len, config.kv_cache_dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model)
        self._detok_tokenizer = self.tokenizer  # see thread_safe_tokenizer
        self.model_name = config.model.rstrip("/").split("/")[-1]
        self.eos_token_ids = self._eos_ids()
        self.vocab_size = self.runner.model.vocab_size
        # structured output: tokenizer info once per model (the logits width; EOS = grammar stop)
        self.tokenizer_info = build_tokenizer_info(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self.grammars = GrammarCompilerService(
            self.tokenizer_info,
            cache_size=config.grammar_cache_size,
            cache_max_bytes=config.grammar_cache_bytes,
            timeout_s=config.grammar_compile_timeout,
            max_workers=config.grammar_compile_workers,
        )
        self.bitmask = StructuredBitmask(self.vocab_size, self.runner.device)
        self._compiling: list[Request] = []  # requests whose grammar is not compiled yet
        # set when a compile of a request in _compiling finishes, or by wake(): what a step with
        # nothing to run but compiles pending sleeps on
        self._grammar_wake = threading.Event()

        block_bytes = self.runner.block_bytes(config.block_size)
        budget = self.runner.device_kv_budget(config.kv_cache_memory, config.gpu_memory_utilization, config.cpu_kv_cache_memory)
        num_blocks = budget // block_bytes
        if num_blocks < 2:
            raise ValueError(f"KV budget of {budget} bytes holds {num_blocks} blocks of {block_bytes} bytes; need at least 2")
        num_cpu_blocks = config.swap_space // block_bytes
        self.runner.allocate_kv_cache(num_blocks, num_cpu_blocks, config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, num_cpu_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        self.spec = config.speculative_config
        self.spec_stats = SpecDecodeStats()
        self.spec_policy = AutoPolicy(self.spec.num_speculative_tokens) if self.spec is not None and self.spec.policy == "auto" else None
        # a lone sequence must always fit in the pool, or it could never finish
        self.max_model_len = min(self.runner.max_model_len, num_blocks * config.block_size)

        self.requests: dict[str, Request] = {}
        self._deadlines: list[tuple[float, int, Request]] = []  # min-heap of requests with a deadline
        self._arrivals = itertools.count()
        self._generator = torch.Generator(device="cpu" if self.runner.device.type == "cpu" else self.runner.device)
        self._generator.manual_seed(config.seed)
        self.counters = {
            "prompt_tokens_computed": 0,
            "prompt_tokens_cached": 0,
            "generation_tokens": 0,
            "steps": 0,
            "requests_finished": 0,
            "requests_aborted": 0,
            "requests_expired": 0,
            "requests_failed": 0,
            "steps_failed": 0,
            "requests_invalid_structured": 0,
        }

    def thread_safe_tokenizer(self) -> None:
        """Gives the detokenizers (which run in ``step``) a copy of the tokenizer, for callers that
        step on one thread and use ``tokenizer`` on another (AsyncEngine): a fast tokenizer used
        from two threads at once can raise "Already borrowed". Costs a copy (~0.3 s), so only
        those callers pay it."""
        if self._detok_tokenizer is self.tokenizer:
            self._detok_tokenizer = copy.deepcopy(self.tokenizer)

    def _eos_ids(self) -> set[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        try:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(self.config.model).eos_token_id
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:
            pass
        return ids

    # -- requests ------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a string, token ids, or chat messages (the chat template)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("empty_prompt", "the prompt is empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError("empty_prompt" if isinstance(prompt, list) else "invalid_prompt", "the prompt must be a non-empty string, token id list or message list")
        if all(isinstance(m, dict) for m in prompt):
            for m in prompt:
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise InvalidRequestError("invalid_prompt", "each chat message needs string 'role' and 'content'")
            try:
                ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
            except Exception as e:  # a template may reject role orders etc.
                raise InvalidRequestError("invalid_prompt", f"chat template failed: {e}") from e
            return list(ids)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError("invalid_prompt", f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
            return list(prompt)
        raise InvalidRequestError("invalid_prompt", "the prompt must be a string, a list of token ids or a list of chat messages")

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("empty_prompt", "the prompt is empty")
        limit = self.max_model_len - 1
        if not self.config.enable_chunked_prefill:  # the whole prompt must fit in one step
            limit = min(limit, self.config.max_num_batched_tokens)
        if len(prompt_token_ids) > limit:
            raise InvalidRequestError(
                "prompt_too_long",
                f"the prompt has {len(prompt_token_ids)} tokens; at most {limit} fit (context {self.max_model_len})",
            )
        params.validate()
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError("invalid_sampling", f"stop_token_ids out of range [0, {self.vocab_size}): {bad[:5]}")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError("invalid_sampling", f"logit_bias token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        room = self.max_model_len - len(prompt_token_ids)
        if params.max_tokens is None and params.min_tokens > room:
            raise InvalidRequestError("invalid_sampling", f"min_tokens {params.min_tokens} exceeds the {room} tokens of context left after the prompt")

    def validate_structured(self, params: SamplingParams) -> None:
        """Blocking (for a worker thread, not the engine loop): compiles ``params``'s structured
        output spec, or finds it cached; raises ``StructuredOutputError`` for a spec the compiler
        refuses or one past the compile timeout. Then pass ``structured_validated=True`` to
        ``add_request`` so the engine's own look-up is not counted as a second cache hit."""
        if params.structured_outputs is not None:
            self.grammars.validate(params.structured_outputs)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, deadline: float | None = None,
                    structured_validated: bool = False) -> Request:
        """Queues a request. ``deadline`` (``time.time()`` seconds): if it passes before the request
        is first scheduled, the request finishes without running (finish_reason "abort",
        ``error_code`` "deadline_exceeded"); once started, it runs to completion. A request with
        ``params.structured_outputs`` waits (unscheduled) for its grammar; see the module docstring."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("invalid_sampling", "params must be a SamplingParams")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("invalid_priority", "priority must be an integer")
        if priority != 0 and self.config.scheduling_policy != "priority":
            # as vLLM: a priority the scheduler would ignore is a caller's mistake, not a no-op
            raise InvalidRequestError("invalid_priority", f"priority {priority} needs scheduling_policy='priority' (this engine is {self.config.scheduling_policy!r})")
        if deadline is not None and (not isinstance(deadline, (int, float)) or isinstance(deadline, bool) or deadline != deadline):
            raise InvalidRequestError("invalid_deadline", "deadline must be a number (Unix time) or None")
        ids = self.encode(prompt)
        self.check(ids, params)
        params = params.resolved(self.max_model_len - len(ids))  # max_tokens=None: up to the context
        order = next(self._arrivals)
        req = Request(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=ids,
            params=params,
            priority=priority,
            arrival_order=order,
            metrics=RequestMetrics(arrival_time=time.time()),
            sort_key=(priority if self.config.scheduling_policy == "priority" else 0, order),
            deadline=deadline,
        )
        req.seqs.append(self._new_seq(req, 0))
        if params.structured_outputs is not None:
            req.grammar = self.grammars.submit(params.structured_outputs, admitted=structured_validated)
            req.grammar.add_done_callback(self._grammar_done)
            self._compiling.append(req)
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, order, req))
        return req

    def _new_seq(self, req: Request, index: int) -> Sequence:
        p = req.params
        seq = Sequence(request=req, index=index, token_ids=list(req.prompt_token_ids), num_prompt_tokens=len(req.prompt_token_ids))
        if p.seed is not None:
            seq.generator = torch.Generator(device=self._generator.device)
            seq.generator.manual_seed(p.seed + index)
        seq.logprobs = [] if p.logprobs is not None else None
        seq.detokenizer = IncrementalDetokenizer(self._detok_tokenizer, req.prompt_token_ids, p.stop, p.skip_special_tokens, p.include_stop_str_in_output)
        return seq

    def abort(self, request_id: str, error: str | None = None, error_code: str | None = None) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._end(req, error, error_code)
        self.counters["requests_aborted"] += 1
        return req

    def _end(self, req: Request, error: str | None, error_code: str | None) -> None:
        """Finishes every unfinished choice of ``req`` with ABORT (the caller has taken it out of
        ``self.requests``)."""
        req.error = error
        req.error_code = error_code
        for seq in req.seqs:
            if not seq.finished:
                self._finish(seq, ABORT)
        req.metrics.finished_time = time.time()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Runs one step; returns the requests whose state changed (finished ones are removed from
        ``self.requests`` and returned one last time). A failing step does not raise: see
        ``_recover``."""
        expired = self._expire_deadlines() if self._deadlines else []
        if self._compiling:
            self._grammar_wake.clear()  # before the poll: a compile finishing after it wakes the wait below
            expired += self._poll_grammars()
        t0 = time.perf_counter()
        try:
            drafts = self._propose() if self.spec is not None else None
            # without drafts, the plain call: benches and tests wrap schedule() with no arguments
            sched = self.scheduler.schedule(drafts) if drafts else self.scheduler.schedule()
        except BaseException:
            # a bookkeeping bug (not a model failure) or an interrupt: the caller fails what is in
            # flight; drop the half-made step so no copy of it is applied later and no unwritten
            # block stays hit-able
            self.kv.unregister(self.kv.take_registered())
            self.kv.take_copies()
            raise
        if sched.empty and not sched.copies and self._compiling:
            # nothing can run until a grammar is ready: sleep until a compile finishes, wake() is
            # called or the next deadline is due, rather than spin
            self._grammar_wake.wait(self._grammar_wait_s())
        steps = self.counters["steps"]
        changed = self._run(sched)
        if self.spec_policy is not None and self.counters["steps"] > steps and self._decode_only(sched):
            self.spec_policy.observe_step(sched.num_batched_tokens, time.perf_counter() - t0)
        return expired + changed

    @staticmethod
    def _decode_only(sched: SchedulerOutput) -> bool:
        """Every chunk is a decode or a verification: the step's cost is a function of its rows."""
        return not sched.copies and all(s.num_new_tokens - len(s.draft) == 1 for s in sched.scheduled)

    def _propose(self) -> dict[int, list[int]] | None:
        """n-gram drafts for the running sequences that decode this step, by ``seq_id``."""
        spec = self.spec
        drafts: dict[int, list[int]] = {}
        num_decodes = 0
        for seq in self.scheduler.running:
            if seq.num_computed_tokens != len(seq.token_ids) - 1:
                continue
            num_decodes += 1
            # never draft past max_tokens (the bonus token is the last one) or the context
            cap = min(spec.num_speculative_tokens, seq.request.params.max_tokens - seq.num_output_tokens - 1,
                      self.max_model_len - len(seq.token_ids))
            if cap <= 0:
                continue
            if seq.ngram is None:
                seq.ngram = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
            draft = seq.ngram.propose(seq.token_ids, cap)
            if draft and seq.structured is not None:
                draft = self._grammar_prefix(seq, draft)
            if draft:
                drafts[seq.seq_id] = draft
        if self.spec_policy is not None and drafts:
            cap = self.spec_policy.choose_cap(num_decodes, [len(d) for d in drafts.values()])
            drafts = {i: d[:cap] for i, d in drafts.items()} if cap else {}
        return drafts or None

    @staticmethod
    def _grammar_prefix(seq: Sequence, draft: list[int]) -> list[int]:
        """The longest prefix of ``draft`` the grammar allows (verifying a refused token is waste)."""
        st = seq.structured
        if st.is_terminated():
            return []
        n = 0
        try:
            for t in draft:
                if not st.accept(t):
                    break
                n += 1
        finally:
            st.rollback(n)
        return draft[:n]

    def wake(self) -> None:
        """Ends a step's sleep while it waits for grammars (another thread has work for the engine)."""
        self._grammar_wake.set()

    def _grammar_done(self, _handle) -> None:  # on a compile thread
        self._grammar_wake.set()

    def _grammar_wait_s(self) -> float:
        """The longest a step sleeps for grammars: up to the next deadline, at most 0.5 s (a guard)."""
        if not self._deadlines:
            return 0.5
        return min(0.5, max(0.0, self._deadlines[0][0] - time.time()))

    def _poll_grammars(self) -> list[Request]:
        """Requests whose compile is done leave ``_compiling``: a grammar gives the first sequence
        its state; an error finishes the request, never scheduled."""
        failed, still = [], []
        for req in self._compiling:
            if self.requests.get(req.request_id) is not req or req.finished:
                continue  # aborted or expired while compiling
            handle = req.grammar
            if not handle.done:
                still.append(req)
                continue
            err = handle.error
            if err is None:
                req.seqs[0].structured = StructuredState(handle.result())
                continue
            del self.requests[req.request_id]
            if isinstance(err, InvalidRequestError):  # the spec's fault: refused, or past its budget
                self._end(req, str(err), ERR_STRUCTURED)
                self.counters["requests_invalid_structured"] += 1
            else:  # no compile process could run it: ours, retryable
                self._end(req, f"grammar compiler unavailable: {err}", ERR_ENGINE)
            failed.append(req)
        self._compiling = still
        return failed

    def _run(self, sched: SchedulerOutput) -> list[Request]:
        filled = None
        try:
            if sched.empty:
                if sched.copies:  # a step that runs nothing still owes its swap-outs
                    self.runner.kv.apply(sched.copies.swap_out, sched.copies.swap_in, sched.copies.copy)
                return []
            now = time.time()
            # decodes first, then verifications: attention runs them as one batched decode call
            order = sorted(sched.scheduled, key=lambda s: 0 if s.num_new_tokens == 1 else 1 if s.draft else 2)
            for s in order:
                m = s.seq.request.metrics
                if m.first_scheduled_time is None:
                    m.first_scheduled_time = now
            batch = Batch(
                chunks=[self._chunk(s) for s in order],
                swap_out=sched.copies.swap_out,
                swap_in=sched.copies.swap_in,
                copy=sched.copies.copy,
            )
            # everything that can fail runs before any request state moves
            sampling, rows, drafts, num_rows = self._sampling_rows(order)
            constrained = [(i, s.structured) for i, s in enumerate(sampling) if s.structured is not None]
            # the constrained rows' masks are filled on a helper thread during the forward pass
            filled = self.bitmask.start_fill(len(sampling), constrained) if constrained else None
            logits = self.runner.execute(batch)
            tokens, logprobs = [], []
            if sampling and any(drafts):
                tokens, logprobs = verify(logits, sampling, rows, drafts, self.eos_token_ids, self._generator,
                                          bitmask=self.bitmask, filled=filled)
            elif sampling:
                if num_rows != len(rows):  # forks sample from their parent's row: repeat it
                    logits = logits[torch.tensor(rows, device=logits.device)]
                ids, lps = sample(logits, sampling, self.eos_token_ids, self._generator,
                                  bitmask=self.bitmask if constrained else None, constrained=constrained, filled=filled)
                tokens, logprobs = [[t] for t in ids], [[lp] for lp in lps]
        except BaseException as e:
            if filled is not None:  # the fill reads the states: let it finish before they move
                filled.exception()
            if not isinstance(e, Exception):
                # an interrupt (Ctrl-C) ends the step for good: the caller aborts what it queued,
                # but blocks the step registered and never wrote must not outlive it in the prefix map
                self._withdraw(sched)
                raise
            return self._recover(sched, e)
        self.counters["steps"] += 1
        changed = self._update(order, sampling, drafts, tokens, logprobs)
        if self.scheduler.suspects:
            self._clear_suspect()
        return changed

    def _expire_deadlines(self) -> list[Request]:
        """Finishes the requests whose deadline has passed before they were ever scheduled."""
        now = time.time()
        expired = []
        if len(self._deadlines) > 2 * len(self.requests) + 64:
            # entries of requests that started or ended stay until their deadline: drop them now
            # and then, so generous deadlines cannot keep finished requests alive
            self._deadlines = [e for e in self._deadlines if not e[2].admitted and self.requests.get(e[2].request_id) is e[2]]
            heapq.heapify(self._deadlines)
        while self._deadlines and self._deadlines[0][0] < now:
            _, _, req = heapq.heappop(self._deadlines)
            if req.admitted or self.requests.get(req.request_id) is not req:
                continue  # started (it runs to completion), finished or aborted
            del self.requests[req.request_id]
            self._end(req, f"the deadline passed {now - req.deadline:.3f}s before the request could start", ERR_DEADLINE)
            self.counters["requests_expired"] += 1
            expired.append(req)
        return expired

    def _recover(self, sched: SchedulerOutput, exc: Exception) -> list[Request]:
        """A step raised (a block copy, the forward or the sampler). No request state moved past
        the schedule, but the step's KV may be missing or half-written. So: its prefix-map entries
        are withdrawn, and every sequence whose KV is now untrusted (those scheduled, swapped in or
        out this step, or holding a withdrawn block) is recomputed from scratch; greedy and seeded
        sampling give the same tokens as without the failure. Blame: a step of one request fails
        that request (``error_code`` "engine_error"); otherwise its requests become suspects that
        run alone, one by one, past the point of failure, so a request that breaks every step it
        is in ends up failing alone and no other request gets an error."""
        log.warning("engine step failed: %r", exc, exc_info=exc)
        self.counters["steps_failed"] += 1
        self._withdraw(sched)
        step_reqs = list(dict.fromkeys(s.seq.request for s in sched.scheduled))
        if len(step_reqs) == 1:
            req = step_reqs[0]
            if self.requests.pop(req.request_id, None) is None:
                return []
            self._end(req, f"engine step failed: {exc!r}", ERR_ENGINE)
            self.counters["requests_failed"] += 1
            if req in self.scheduler.suspects:
                self.scheduler.suspects.remove(req)
            return [req]
        for req in step_reqs:
            for seq in req.seqs:
                if not seq.finished:
                    seq.suspect_until = max(seq.suspect_until, len(seq.token_ids))
            if req not in self.scheduler.suspects:
                self.scheduler.suspects.append(req)
        return []

    def _withdraw(self, sched: SchedulerOutput) -> None:
        """A step that did not run to the end: its prefix-map entries are withdrawn and every
        sequence whose KV is now untrusted (scheduled, swapped in or out this step, or holding a
        withdrawn block) goes back to waiting, to be recomputed from scratch."""
        self.kv.unregister(sched.registered)
        untrusted = [s.seq for s in sched.scheduled] + [seq for seq, mode in sched.preempted if mode == "swap"] + sched.swapped_in
        withdrawn = {b.block_id for b in sched.registered}
        if withdrawn:
            untrusted += [seq for seq in self.scheduler.running if any(b.block_id in withdrawn for b in seq.block_table)]
        for seq in dict.fromkeys(untrusted):
            if not seq.finished:
                self.scheduler.requeue(seq)

    def _clear_suspect(self) -> None:
        """The isolated suspect is cleared once it has computed, alone, what it had at the failure."""
        req = self.scheduler.suspects[0]
        if all(s.finished or s.num_computed_tokens >= s.suspect_until for s in req.seqs):
            self.scheduler.suspects.pop(0)
            for s in req.seqs:
                s.suspect_until = 0

    def _chunk(self, s: ScheduledSeq) -> SeqChunk:
        seq = s.seq
        start = seq.num_computed_tokens
        num_plain = s.num_new_tokens - len(s.draft)
        return SeqChunk(
            token_ids=seq.token_ids[start : start + num_plain] + s.draft,
            start_pos=start,
            block_ids=[b.block_id for b in seq.block_table],
            needs_logits=s.samples,
            num_draft=len(s.draft),
        )

    def _sampling_rows(self, order: list[ScheduledSeq]) -> tuple[list[Sequence], list[int], list[list[int]], int]:
        """The sequences that sample this step, with their (first) logits rows and drafts (a
        verifying sequence has ``1 + len(draft)`` consecutive rows); a request whose prompt just
        finished brings its ``n - 1`` forks (new, not yet attached: nothing changes here)."""
        sampling: list[Sequence] = []
        rows: list[int] = []
        drafts: list[list[int]] = []
        num_rows = 0
        for s in order:
            if not s.samples:
                continue
            seq = s.seq
            sampling.append(seq)
            rows.append(num_rows)
            drafts.append(s.draft)
            req = seq.request
            if req.params.n > 1 and not req.forked:
                for i in range(1, req.params.n):
                    child = self._new_seq(req, i)
                    if seq.structured is not None:  # its own parse state (a copy; the parent's is untouched)
                        child.structured = seq.structured.fork()
                    sampling.append(child)
                    rows.append(num_rows)
                    drafts.append([])
            num_rows += 1 + len(s.draft)
        return sampling, rows, drafts, num_rows

    def _update(self, order: list[ScheduledSeq], sampling: list[Sequence], drafts: list[list[int]],
                tokens: list[list[int]], logprobs: list[list]) -> list[Request]:
        """``tokens[i]``: what ``sampling[i]`` appends this step, in order (for a verified draft,
        the accepted draft tokens and then the correction or bonus token)."""
        accepted = {seq.seq_id: len(t) - 1 for seq, d, t in zip(sampling, drafts, tokens) if d}
        for s in order:
            seq = s.seq
            if seq.num_output_tokens == 0:
                self.counters["prompt_tokens_computed"] += s.num_new_tokens
            if s.draft:
                # the last token and the accepted drafts are computed; the rejected drafts' slots
                # are released (their KV is garbage past num_computed_tokens, never hashed)
                num_acc = accepted[seq.seq_id]
                seq.num_computed_tokens += s.num_new_tokens - len(s.draft) + num_acc
                self.kv.trim(seq)
                self.spec_stats.observe(len(s.draft), num_acc)
                if self.spec_policy is not None:
                    self.spec_policy.observe_draft(len(s.draft), num_acc)
            else:
                seq.num_computed_tokens += s.num_new_tokens
        if accepted:
            self.spec_stats.num_spec_steps += 1
        if not sampling:
            return []
        now = time.time()
        changed: dict[str, Request] = {}
        # attach new forks before any sequence can finish: a parent that stops on its first token
        # frees its blocks, and a fork attached after that would share an empty block table
        for seq in sampling:
            req = seq.request
            if seq.index > 0 and len(req.seqs) <= seq.index:  # a new fork of seqs[0], just scheduled
                self.scheduler.add_fork(req.seqs[0], seq)
                req.seqs.append(seq)
                req.forked = len(req.seqs) == req.params.n
        for seq, seq_tokens, seq_lps in zip(sampling, tokens, logprobs):
            req = seq.request
            changed[req.request_id] = req
            for token, lp in zip(seq_tokens, seq_lps):
                if self._append(seq, token, lp, now):
                    break  # finished: the rest of an accepted run is cut here
        for req in changed.values():
            if req.finished and self.requests.pop(req.request_id, None) is not None:
                req.metrics.finished_time = now
                self.counters["requests_finished"] += 1
        return list(changed.values())

    def _append(self, seq: Sequence, token: int, lp, now: float) -> bool:
        """Appends one generated token with everything that follows from it; True if ``seq``
        finished (a stop, the length, or a token its grammar refuses)."""
        req = seq.request
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        self.counters["generation_tokens"] += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            self.counters["prompt_tokens_cached"] += req.num_cached_tokens
        if seq.structured is not None and not seq.structured.accept(token):
            # cannot happen after the mask; a guard so a refused token never continues
            log.error("request %s: sampled token %d does not fit its grammar", req.request_id, token)
            seq.detokenizer.append(token, find_stop=False)
            self._finish(seq, ABORT)
            return True
        reason = self._stop(seq, token)
        if reason is not None:
            self._finish(seq, *reason)
            return True
        return False

    def _stop(self, seq: Sequence, token: int) -> tuple[str, str | int | None] | None:
        """Feeds ``token`` to the detokenizer and decides whether ``seq`` stops (vLLM's order and
        rules: nothing but the length stops it before ``min_tokens``; the text of a stop token id
        or EOS is left out unless ``include_stop_str_in_output``)."""
        p = seq.request.params
        if seq.structured is not None and seq.structured.is_terminated():
            # the grammar is complete and took its stop token (EOS): that ends it, whatever
            # ignore_eos or min_tokens say (the mask allowed nothing else)
            if p.include_stop_str_in_output:
                seq.detokenizer.append(token, find_stop=False)
            return STOP, (token if token in p.stop_token_ids else None)
        past_min = seq.num_output_tokens >= p.min_tokens
        if past_min and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            if p.include_stop_str_in_output:
                seq.detokenizer.append(token, find_stop=False)
            return STOP, (token if token in p.stop_token_ids else None)
        stop_str = seq.detokenizer.append(token, find_stop=past_min)
        if stop_str is not None:
            return STOP, stop_str
        if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return LENGTH, None
        return None

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        seq.detokenizer.flush()
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED

    # -- introspection -------------------------------------------------------------------------
    def capacity(self) -> Capacity:
        pool = self.kv.pool
        bs = self.kv.block_size
        pending = sum(len(s.token_ids) for s in self.scheduler.waiting) + sum(
            len(s.token_ids) - s.num_computed_tokens for s in self.scheduler.running
        )
        free = pool.num_free * bs - pending
        return Capacity(max(free, 0), pool.num_blocks * bs, bs, len(self.scheduler.running), len(self.scheduler.waiting) + len(self.scheduler.swapped))

    def stats(self) -> dict:
        pool = self.kv.pool
        used_tokens = sum(s.num_computed_tokens for s in self.scheduler.running)
        used_slots = sum(len(s.block_table) for s in self.scheduler.running) * self.kv.block_size
        return {
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used,
            "kv_blocks_cached_free": pool.num_cached_free,
            "kv_blocks_free": pool.num_free,
            "kv_usage": pool.num_used / pool.num_blocks,
            "kv_slot_utilization": used_tokens / used_slots if used_slots else 1.0,
            "cpu_swap_blocks_total": self.kv.cpu_pool.num_blocks,
            "cpu_swap_blocks_used": self.kv.cpu_pool.num_blocks - self.kv.cpu_pool.num_free,
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "preemptions_swap": self.scheduler.num_preemptions["swap"],
            "preemptions_recompute": self.scheduler.num_preemptions["recompute"],
            "blocks_swapped_out": self.kv.blocks_swapped_out,
            "blocks_swapped_in": self.kv.blocks_swapped_in,
            "blocks_evicted": pool.num_evicted,
            "cow_copies": self.kv.cow_copies,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "num_compiling": len(self._compiling),
            **self.counters,
            **self.spec_stats.as_dict(),
            **(self.spec_policy.stats() if self.spec_policy is not None else {}),
            **self.grammars.stats(),
            **self.bitmask.stats(),
        }
