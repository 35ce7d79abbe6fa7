"""The synchronous engine: requests in, one ``step()`` at a time, updated requests out.

A step: schedule -> prepare the batch -> forward -> sample -> outputs (``_update``, the only
place that mutates request state after a step). Around it, collaborators own their state and
their hooks:

- ``RequestBook`` (``requests.py``): the requests in flight, their deadlines, validation, and how
  a request enters and ends (add, abort, a token that stops a choice).
- ``StructuredOutputs`` (``structured/outputs.py``): grammar compiles (a constrained request
  waits unscheduled for its grammar), the step's masks, and the sleep of a step that has
  nothing to run but compiles.
- ``Speculator`` (``spec_decode/speculator.py``): n-gram drafts before the schedule, their
  verification in place of the sampler, and the counters and ``auto`` policy.
- ``LoRAManager`` (``lora_manager.py``): LoRA adapters: loads off the step (a request waits
  unscheduled for its adapter), the CPU cache, and the device slots filled before each forward.
- ``step_recovery.py``: a step that failed or was interrupted (its KV untrusted, blame).
"""

from __future__ import annotations

import copy
import gc
import time

import torch
from transformers import AutoTokenizer

from kernels.env import switch
from qworker.engine.config import EngineConfig
from qworker.engine.introspection import Capacity, engine_capacity, engine_stats
from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.lora_manager import LoRAManager
from qworker.engine.lora_request import LoRARequest
from qworker.engine.requests import Prompt, RequestBook, eos_token_ids
from qworker.engine.sampler import sample
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from qworker.engine.sequence import Request, Sequence
from qworker.engine.spec_decode.speculator import Speculator
from qworker.engine.step_batch import prepare, sampling_rows
from qworker.engine.step_recovery import clear_suspect, recover, withdraw
from qworker.engine.structured.outputs import StepMasks, StructuredOutputs
from qworker.engine.transient_thread import in_transient_thread
from qworker.host_memory import available_memory
from qworker.model.parallel.errors import ExecutorFailed
from qworker.model.loader import load_config
from qworker.model.runner import ModelRunner

__all__ = ["Capacity", "LLMEngine", "Prompt"]

_start_up_heap_frozen = False


def _freeze_start_up_heap() -> None:
    """Move what exists once the process's first engine has started (the model's modules and
    tensors, the tokenizer, the libraries: hundreds of thousands of objects) out of the cyclic
    garbage collector's reach, as vLLM's engine core does: each full collection would otherwise
    walk them all again in the middle of a step (~1-2% of a CPU run's samples). Once per process:
    a frozen object is never collected if it ends up in a reference cycle, so a process that
    builds and drops engines (tests) keeps at most the first; a worker runs one for its life."""
    global _start_up_heap_frozen
    if _start_up_heap_frozen or not switch("QWORKER_GC_FREEZE"):
        return
    _start_up_heap_frozen = True
    gc.collect()
    gc.freeze()


def load_tokenizer(path: str):
    """``path``'s tokenizer; one line naming the folder when transformers finds none it can read
    there (its own error blames missing packages, in many lines)."""
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{path}: no tokenizer that transformers can load (tokenizer.json, tokenizer.model or "
                         f"vocabulary files; tokenizer=DIR names another folder): {why}") from None


def _check_host_memory(needed: int) -> None:
    """The KV pages the engine commits in host memory when it starts must fit what this process
    can still allocate: a budget past it ("1T") had the machine's OOM killer end the worker, or a
    neighbour, while the pool was being filled."""
    available = available_memory()
    if available and needed > available:
        raise ValueError(f"the KV cache needs {needed / 2**30:.1f} GiB of host memory (kv_cache_memory on a CPU, swap_space beside a GPU), "
                         f"but this process can allocate {available / 2**30:.1f} GiB: lower QWORKER_KV_CACHE_MEMORY / swap_space")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        # in a thread of its own: the OpenMP pool start-up creates must not outlive it in the
        # caller's thread, or the thread that steps the engine runs its regions throttled
        # (see transient_thread.py)
        in_transient_thread(self._start, config)

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        load_config(config.model)  # config.json's faults in one line naming it (the tokenizer reads it too)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)  # before the weights: fail fast
        if config.tensor_parallel_size > 1:  # rank 0 of a tensor-parallel group: the followers start here
            from qworker.model.parallel.leader import ParallelRunner

            self.runner = ParallelRunner(config.tensor_parallel_size, config.model, config.device, config.dtype, config.max_model_len,
                                         config.kv_cache_dtype)
        else:
            self.runner = ModelRunner(config.model, config.device, config.dtype, config.max_model_len, config.kv_cache_dtype)
        try:
            self._start_after_runner(config)
        except BaseException:
            # the engine is never returned, so nobody else would stop a tensor-parallel runner's
            # follower processes (its finalizer runs only once the traceback lets go of it)
            close = getattr(self.runner, "close", None)
            if close is not None:
                close()
            raise

    def _start_after_runner(self, config: EngineConfig) -> None:
        self._unreported: list[Request] = []  # see take_unreported
        self.model_name = config.model.rstrip("/").split("/")[-1]
        self.vocab_size = self.runner.model.vocab_size
        self.eos_token_ids = eos_token_ids(self.tokenizer, config.model, self.vocab_size)
        self.structured = StructuredOutputs(config, self.tokenizer, self.vocab_size, self.eos_token_ids, self.runner.device)

        # LoRA slots before the KV budget: on a GPU they take memory the pool must not count on
        self.loras = LoRAManager(config, self.runner, {})
        block_bytes = self.runner.block_bytes(config.block_size)
        budget = self.runner.device_kv_budget(config.kv_cache_memory, config.gpu_memory_utilization, config.cpu_kv_cache_memory)
        num_blocks = budget // block_bytes
        if num_blocks < 2:
            raise ValueError(f"KV budget of {budget} bytes holds {num_blocks} blocks of {block_bytes} bytes; need at least 2")
        num_cpu_blocks = config.swap_space // block_bytes
        # committed at once: the pool on a CPU (zeroed), the swap space beside a GPU (pinned); a CPU
        # worker's swap space is left unwritten until a swap-out, and costs nothing until then. A
        # CPU pool sized as a share of the memory measured before the load is not checked again
        # (what the load itself took would refuse a valid share such as 1.0): only a byte count
        if self.runner.device.type == "cpu":
            committed = num_blocks if config.kv_cache_memory is not None else 0
        else:
            committed = num_cpu_blocks
        if committed:
            _check_host_memory(block_bytes * committed)
        self.runner.allocate_kv_cache(num_blocks, num_cpu_blocks, config.block_size)
        self.kv = KVCacheManager(num_blocks, config.block_size, num_cpu_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.kv)
        # a lone sequence must always fit in the pool, or it could never finish
        self.max_model_len = min(self.runner.max_model_len, num_blocks * config.block_size)
        self.speculator = Speculator(config.speculative_config, self.max_model_len)

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
        self.book = RequestBook(config, self.scheduler, self.tokenizer, self.vocab_size, self.max_model_len,
                                self.eos_token_ids, self._generator.device, self.counters)
        self.requests = self.book.requests  # the same dict: the requests in flight
        self.loras.requests = self.requests
        _freeze_start_up_heap()

    def thread_safe_tokenizer(self) -> None:
        """Gives the detokenizers (which run in ``step``) a copy of the tokenizer, for callers that
        step on one thread and use ``tokenizer`` on another (AsyncEngine): a fast tokenizer used
        from two threads at once can raise "Already borrowed". Costs a copy (~0.3 s), so only
        those callers pay it."""
        if self.book.detok_tokenizer is self.tokenizer:
            self.book.detok_tokenizer = copy.deepcopy(self.tokenizer)

    # -- collaborators' state that callers reach ---------------------------------------------------
    @property
    def grammars(self):
        return self.structured.grammars

    @grammars.setter
    def grammars(self, service) -> None:  # tests swap in a compiler service with hooks
        self.structured.grammars = service

    @property
    def tokenizer_info(self):
        return self.structured.tokenizer_info

    @property
    def spec_policy(self):  # bench/spec_decode.py reports the auto policy's state
        return self.speculator.policy

    @property
    def _compiling(self) -> list[Request]:
        return self.structured.compiling

    @property
    def _deadlines(self) -> list:
        return self.book.deadlines

    # -- requests --------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a string, token ids, or chat messages (the chat template)."""
        return self.book.encode(prompt)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.book.check(prompt_token_ids, params)

    def validate_structured(self, params: SamplingParams) -> None:
        """Blocking (for a worker thread, not the engine loop): compiles ``params``'s structured
        output spec, or finds it cached; raises ``StructuredOutputError`` for a spec the compiler
        refuses or one past the compile timeout. Then pass ``structured_validated=True`` to
        ``add_request`` so the engine's own look-up is not counted as a second cache hit."""
        self.structured.validate(params)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, deadline: float | None = None,
                    structured_validated: bool = False, lora_request: LoRARequest | None = None) -> Request:
        """Queues a request. ``deadline`` (``time.time()`` seconds): if it passes before the request
        is first scheduled, the request finishes without running (finish_reason "abort",
        ``error_code`` "deadline_exceeded"); once started, it runs to completion. A request with
        ``params.structured_outputs`` waits (unscheduled) for its grammar; see ``structured/outputs.py``.
        ``lora_request``: the LoRA adapter it runs under (None: the base model); it waits
        (unscheduled) while the adapter loads, and ends with ``error_code`` "invalid_lora" if the
        load fails; see ``lora_manager.py``."""
        self.loras.check(lora_request)
        req = self.book.make(request_id, prompt, params, priority, deadline, time.time(), lora_request)
        self.structured.submit(req, structured_validated)
        self.loras.submit(req)
        self.book.record(req)
        self.scheduler.add(req.seqs[0])
        return req

    def abort(self, request_id: str, error: str | None = None, error_code: str | None = None) -> Request | None:
        req = self.book.abort(request_id, error, error_code, time.time())
        self.loras.trim()
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def wake(self) -> None:
        """Ends a step's sleep while it waits for grammars or adapters (another thread has work
        for the engine)."""
        self.structured.wake()
        self.loras.wake()

    # -- LoRA adapters (vLLM's names) ------------------------------------------------------------
    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """Raises ``InvalidRequestError`` ("invalid_lora") for a ``lora_request`` this engine can
        never serve (LoRA off, not a LoRARequest, its id taken by another folder)."""
        self.loras.check(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads and validates an adapter into the CPU cache now (blocking); raises
        ``InvalidRequestError`` ("invalid_lora") with the loader's reason."""
        return self.loras.add(lora_request)

    def add_lora_loaded(self, lora_request: LoRARequest, adapter) -> bool:
        """``add_lora`` with the adapter already read by ``loras.load`` (on another thread)."""
        return self.loras.add(lora_request, adapter)

    def remove_lora(self, lora_id: int) -> bool:
        """Drops an adapter that no request in flight uses; False if none was dropped."""
        return self.loras.remove(lora_id)

    def list_loras(self) -> set[int]:
        return self.loras.list()

    def lora_stats(self) -> dict:
        """``{"running": {name: requests}, "waiting": {name: requests}, "max_lora": max_loras}``."""
        return self.loras.request_counts()

    # -- the step ----------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Runs one step; returns the requests whose state changed (finished ones are removed from
        ``self.requests`` and returned one last time). A failing step does not raise: see
        ``step_recovery.recover``. A defect that does raise leaves what the step had already ended
        (expired, a failed compile or adapter load: out of ``requests``) to ``take_unreported``."""
        ended, self._unreported = self._unreported, []
        try:
            changed = self._step(ended)
        except BaseException:
            self._unreported = ended
            raise
        self.loras.trim()  # adapters only finished requests named may leave the CPU cache now
        return changed

    def _step(self, ended: list[Request]) -> list[Request]:
        """``step``'s body; ``ended`` grows in place, so a raise anywhere leaves it complete."""
        if self.book.deadlines:
            ended += self.book.expire(time.time())
        ended += self.structured.poll(self.book, time.time())
        ended += self.loras.poll(self.book, time.time())
        t0 = time.perf_counter()
        try:
            drafts = self.speculator.propose(self.scheduler.running)
            # without drafts, the plain call: benches and tests wrap schedule() with no arguments
            sched = self.scheduler.schedule(drafts) if drafts else self.scheduler.schedule()
        except BaseException:
            # a bookkeeping bug (not a model failure) or an interrupt: the caller fails what is in
            # flight; drop the half-made step so no copy of it is applied later and no unwritten
            # block stays hit-able
            self.kv.unregister(self.kv.take_registered())
            self.kv.take_copies()
            raise
        self.structured.wait_if_idle(sched, self.book.seconds_to_deadline(time.time(), 0.5))
        self.loras.wait_if_idle(sched, self.book.seconds_to_deadline(time.time(), 0.5))
        steps = self.counters["steps"]
        changed = self._run(sched)
        self.speculator.observe_step(sched, self.counters["steps"] > steps, time.perf_counter() - t0)
        return ended + changed

    def take_unreported(self) -> list[Request]:
        """Requests that a step ended (and took out of ``requests``) before it raised: no step has
        returned them yet. A caller that recovers from the exception reports them."""
        unreported, self._unreported = self._unreported, []
        return unreported

    def _run(self, sched: SchedulerOutput) -> list[Request]:
        masks: StepMasks | None = None
        seeded: list[tuple[torch.Generator, torch.Tensor]] = []
        try:
            if sched.empty:
                if sched.copies:  # a step that runs nothing still owes its swap-outs
                    self.runner.kv.apply(sched.copies.swap_out, sched.copies.swap_in, sched.copies.copy)
                return []
            order, batch = prepare(sched, time.time(), self.loras.activate(sched.scheduled, self.scheduler.running.loras))
            # everything that can fail runs before any request state moves
            sampling, rows, drafts, num_rows = sampling_rows(order, self._new_fork)
            masks = self.structured.start_masks(sampling)
            logits = self.runner.execute(batch)
            # a sampler that fails after drawing (the logprobs part, a verification's later
            # positions) must leave seeded requests' streams where they were: the step is redone
            seeded = [(g, g.get_state()) for g in {id(q.generator): q.generator for q in sampling if q.generator is not None}.values()]
            tokens, logprobs = self._sample(logits, sampling, rows, drafts, num_rows, masks)
        except BaseException as e:
            for generator, state in seeded:
                generator.set_state(state)
            if masks is not None:
                masks.settle()
            if not isinstance(e, Exception) or isinstance(e, ExecutorFailed):
                # an interrupt (Ctrl-C) or a dead tensor-parallel rank (no request to blame, none can
                # run) ends the step for good: the caller aborts what it queued (or exits), but
                # blocks the step registered and never wrote must not outlive it in the prefix map
                withdraw(self.kv, self.scheduler, sched)
                raise
            return recover(self.kv, self.scheduler, self.book, sched, e, time.time())
        self.counters["steps"] += 1
        changed = self._update(order, sampling, drafts, tokens, logprobs)
        if self.scheduler.suspects:
            clear_suspect(self.scheduler)
        return changed

    def _new_fork(self, req: Request, index: int, parent: Sequence) -> Sequence:
        child = self.book.new_seq(req, index)
        self.structured.fork(parent, child)
        return child

    def _sample(self, logits: torch.Tensor, sampling: list[Sequence], rows: list[int], drafts: list[list[int]],
                num_rows: int, masks: StepMasks) -> tuple[list[list[int]], list[list]]:
        """What each sampling sequence appends: one token, or a verified draft's run."""
        if not sampling:
            return [], []
        if any(drafts):
            return self.speculator.verify(logits, sampling, rows, drafts, self.eos_token_ids, self._generator,
                                          self.structured.bitmask, masks.filled)
        if num_rows != len(rows):  # forks sample from their parent's row: repeat it
            logits = logits[torch.tensor(rows, device=logits.device)]
        ids, lps = sample(logits, sampling, self.eos_token_ids, self._generator,
                          bitmask=self.structured.bitmask if masks.constrained else None, constrained=masks.constrained, filled=masks.filled)
        return [[t] for t in ids], [[lp] for lp in lps]

    def _update(self, order: list[ScheduledSeq], sampling: list[Sequence], drafts: list[list[int]],
                tokens: list[list[int]], logprobs: list[list]) -> list[Request]:
        """``tokens[i]``: what ``sampling[i]`` appends this step, in order (for a verified draft,
        the accepted draft tokens and then the correction or bonus token)."""
        accepted = {seq.seq_id: len(t) - 1 for seq, d, t in zip(sampling, drafts, tokens) if d}
        for s in order:
            seq = s.seq
            if seq.num_output_tokens == 0:  # a prompt's last token may carry drafts: not prompt tokens
                self.counters["prompt_tokens_computed"] += s.num_new_tokens - len(s.draft or ())
            if s.draft:
                # the last token and the accepted drafts are computed; the rejected drafts' slots
                # are released (their KV is garbage past num_computed_tokens, never hashed)
                num_acc = accepted[seq.seq_id]
                seq.num_computed_tokens += s.num_new_tokens - len(s.draft) + num_acc
                self.kv.trim(seq)
                self.speculator.observe_verified(len(s.draft), num_acc)
            else:
                seq.num_computed_tokens += s.num_new_tokens
        if accepted:
            self.speculator.count_spec_step()
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
        failed: set[str] = set()
        for seq, seq_tokens, seq_lps in zip(sampling, tokens, logprobs):
            req = seq.request
            changed[req.request_id] = req
            if req.request_id in failed:
                continue
            try:
                for token, lp in zip(seq_tokens, seq_lps):
                    if self.book.append(seq, token, lp, now):
                        break  # finished: the rest of an accepted run is cut here
            except Exception as e:  # noqa: BLE001 - one request's failure must not end the others'
                failed.add(req.request_id)
                self.book.fail(req, e, now)
        for req in changed.values():
            if req.finished and self.requests.pop(req.request_id, None) is not None:
                req.metrics.finished_time = now
                self.counters["requests_finished"] += 1
        return list(changed.values())

    # -- introspection -------------------------------------------------------------------------
    def capacity(self) -> Capacity:
        return engine_capacity(self.kv, self.scheduler)

    def stats(self) -> dict:
        stats = engine_stats(self.kv, self.scheduler, self.counters, self.structured, self.speculator)
        stats.update(self.loras.stats())
        if hasattr(self.runner, "stats"):  # tensor parallel: rank 0's step and all-reduce time
            stats.update(self.runner.stats())
        return stats
