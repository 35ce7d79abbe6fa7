"""The engine's structured-output collaborator: compiles, the wait for them, and the step's masks.

A request with ``params.structured_outputs`` has its grammar compiled off the engine thread
(``grammars``); until the compile is done it waits unscheduled (the scheduler skips it, the rest
of the queue goes on), then its first sequence gets a ``StructuredState``. Each step masks the
constrained sampling rows (the fill overlaps the forward pass) and the step's update advances
each state by its sampled token (``RequestBook.append``); a terminated grammar finishes the
sequence with "stop". The state only moves in that update, together with ``token_ids``, so a
failed step, a recompute or a swap leaves both consistent (nothing already generated is
re-sampled). A spec the compiler refuses (or a compile past ``grammar_compile_timeout``) finishes
the request, unscheduled, with ``error_code`` "invalid_structured_output"; a compile no process
could run finishes it with "engine_error" (ours, retryable).

``StructuredOutputs`` owns the compiler service, the bitmask, the list of requests whose grammar
is not compiled yet and the event a step with nothing else to do sleeps on.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.outputs import ERR_ENGINE
from qworker.engine.sampling_params import InvalidRequestError, SamplingParams
from qworker.engine.sequence import Request, Sequence
from qworker.engine.structured.bitmask import StructuredBitmask
from qworker.engine.structured.compiler import GrammarCompilerService
from qworker.engine.structured.matcher import StructuredState
from qworker.engine.structured.spec import ERROR_CODE as ERR_STRUCTURED
from qworker.engine.structured.tokenizer_info import build_tokenizer_info

if TYPE_CHECKING:
    from qworker.engine.requests import RequestBook
    from qworker.engine.scheduler import SchedulerOutput


@dataclass(slots=True)
class StepMasks:
    """The constrained ``(row, state)`` pairs of a step's sampling rows, and their fill, started
    before the forward pass (None when no row is constrained)."""

    constrained: list[tuple[int, StructuredState]]
    filled: Future | None

    def settle(self) -> None:
        """A failed step: the fill reads the states, so it must finish before they move."""
        if self.filled is not None:
            self.filled.exception()


class StructuredOutputs:
    def __init__(self, config: EngineConfig, tokenizer, vocab_size: int, eos_token_ids: set[int], device: torch.device):
        # tokenizer info once per model (the logits width; EOS = grammar stop)
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, sorted(eos_token_ids))
        self.grammars = GrammarCompilerService(
            self.tokenizer_info,
            cache_size=config.grammar_cache_size,
            cache_max_bytes=config.grammar_cache_bytes,
            timeout_s=config.grammar_compile_timeout,
            max_workers=config.grammar_compile_workers,
        )
        self.bitmask = StructuredBitmask(vocab_size, device)
        self.compiling: list[Request] = []  # requests whose grammar is not compiled yet
        # set when a compile of a request in ``compiling`` finishes, or by wake(): what a step
        # with nothing to run but compiles pending sleeps on
        self._wake = threading.Event()

    # -- requests --------------------------------------------------------------------------------
    def validate(self, params: SamplingParams) -> None:
        """Blocking (for a worker thread, not the engine loop); see ``LLMEngine.validate_structured``."""
        if params.structured_outputs is not None:
            self.grammars.validate(params.structured_outputs)

    def submit(self, req: Request, validated: bool) -> None:
        """Starts the compile of ``req``'s grammar, if it has one; it waits unscheduled until done."""
        spec = req.params.structured_outputs
        if spec is None:
            return
        req.grammar = self.grammars.submit(spec, admitted=validated)
        req.grammar.add_done_callback(self._grammar_done)
        self.compiling.append(req)

    # -- the step --------------------------------------------------------------------------------
    def poll(self, book: RequestBook, now: float) -> list[Request]:
        """Requests whose compile is done leave ``compiling``: a grammar gives the first sequence
        its state; an error finishes the request, never scheduled. Arms the wake event first, so a
        compile finishing after the poll ends the sleep in ``wait_if_idle``."""
        if not self.compiling:
            return []
        self._wake.clear()
        failed, still = [], []
        for req in self.compiling:
            if book.requests.get(req.request_id) is not req or req.finished:
                continue  # aborted or expired while compiling
            handle = req.grammar
            if not handle.done:
                still.append(req)
                continue
            err = handle.error
            if err is None:
                req.seqs[0].structured = StructuredState(handle.result())
                continue
            del book.requests[req.request_id]
            if isinstance(err, InvalidRequestError):  # the spec's fault: refused, or past its budget
                book.end(req, str(err), ERR_STRUCTURED, now)
                book.counters["requests_invalid_structured"] += 1
            else:  # no compile process could run it: ours, retryable
                book.end(req, f"grammar compiler unavailable: {err}", ERR_ENGINE, now)
            failed.append(req)
        self.compiling = still
        return failed

    def wait_if_idle(self, sched: SchedulerOutput, timeout_s: float) -> None:
        """Nothing can run until a grammar is ready: sleep until a compile finishes, ``wake()`` is
        called or ``timeout_s`` (the next deadline) passes, rather than spin."""
        if sched.empty and not sched.copies and self.compiling:
            self._wake.wait(timeout_s)

    def wake(self) -> None:
        self._wake.set()

    def _grammar_done(self, _handle) -> None:  # on a compile thread
        self._wake.set()

    @staticmethod
    def fork(parent: Sequence, child: Sequence) -> None:
        """A fork of a constrained sequence gets its own parse state (a copy; the parent's is untouched)."""
        if parent.structured is not None:
            child.structured = parent.structured.fork()

    def start_masks(self, sampling: list[Sequence]) -> StepMasks:
        """The constrained rows' masks are filled on a helper thread during the forward pass."""
        constrained = [(i, s.structured) for i, s in enumerate(sampling) if s.structured is not None]
        return StepMasks(constrained, self.bitmask.start_fill(len(sampling), constrained) if constrained else None)
