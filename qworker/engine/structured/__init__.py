"""Structured output (issue 14): JSON schema, JSON object, regex, choice or EBNF grammar, via xgrammar.

Phase 1 (this package) is standalone; phase 2 wires it into the engine in these steps.

1. ``SamplingParams.structured_outputs: StructuredOutputsParams | None = None`` (vLLM's name since
   0.10.2; ``GuidedDecodingParams`` is kept as an alias of the type). The spec validates itself at
   construction and raises ``StructuredOutputError`` (an ``InvalidRequestError``, code
   ``invalid_structured_output``); ``SamplingParams.validate`` only checks the type.
2. ``LLMEngine.__init__``: ``self.tokenizer_info = build_tokenizer_info(self.tokenizer,
   self.vocab_size, self.eos_token_ids)`` (the logits width, not ``len(tokenizer)``; the engine's
   EOS set becomes the grammar's stop tokens); ``self.grammars = GrammarCompilerService(
   self.tokenizer_info, cache_size=..., timeout_s=..., max_workers=...)``;
   ``self.bitmask = StructuredBitmask(self.vocab_size, self.runner.device)``.
3. Admission (worker thread, before the job takes engine time): ``engine.grammars.validate(spec)``
   (blocking, e.g. via ``asyncio.to_thread``) raises ``StructuredOutputError`` for a bad spec or a
   compile past the timeout; the worker already maps ``InvalidRequestError`` to a non-retryable
   error carrying ``e.code`` and the message. ``add_request`` then calls
   ``req.grammar = self.grammars.submit(spec)`` (a cache hit after validate) and keeps the
   request in a ``self._compiling`` list.
4. Waiting for the grammar (vLLM's WAITING_FOR_FSM): at the top of ``LLMEngine.step()``, for each
   request in ``_compiling`` whose ``req.grammar.done``: ``error`` -> ``abort(request_id,
   error=str(err))`` with the code; else ``req.seqs[0].structured =
   StructuredState(req.grammar.result())``. ``Scheduler._admit_waiting``: first thing in the loop,
   ``if seq.request.grammar is not None and seq.structured is None: continue`` (``continue``, not
   ``break``: the rest of the queue is admitted; no budget or blocks taken).
5. Fork (``n > 1``, in ``_update`` after ``child = self._new_seq(req, i)``):
   ``child.structured = seq.structured.fork()`` (a deep copy: each child its own parse state).
6. Sampler: new parameter ``bitmask: StructuredBitmask | None``; first line of ``sample()``:
   ``constrained = [(i, s.structured) for i, s in enumerate(seqs) if s.structured is not None]``
   and ``bitmask.apply(logits, constrained)`` in place, before ``raw = logits`` — so logprobs are
   those of the masked distribution (what vLLM returns: its bitmask is applied before its
   sampler computes raw logprobs), and a sampled token always fits. Rows are the sampling rows
   (forks already have their own repeated row). The ``min_tokens`` EOS ban skips a row whose
   ``seq.structured.is_completed()`` (the grammar wins: otherwise a row that may only stop would
   be all ``-inf``). Seeded rows keep one exponential draw per vocabulary entry, so seeded
   constrained sampling stays batch-independent.
7. ``_update`` (the only mutation point), after ``seq.token_ids.append(token)``:
   ``if seq.structured is not None and not seq.structured.accept(token)`` -> finish ABORT (cannot
   happen after a mask; a guard). ``_stop_reason``: after the stop-string check,
   ``if seq.structured is not None and seq.structured.is_terminated(): return STOP, None`` (before
   the ``ignore_eos`` test: a finished grammar ends the sequence). ``max_tokens`` gives
   ``length`` with a valid prefix. A stop string can end a constrained output early ("stop",
   not complete): document it or drop ``stop`` for constrained jobs.
8. Preemption: recompute keeps ``token_ids`` and the state; the scheduler only samples once the
   sequence has caught up with its last token, so nothing is re-sampled or re-accepted. Swap keeps
   it too. Anything that rebuilds a sequence from tokens uses
   ``StructuredState.replay(grammar, seq.output_token_ids)``.
9. Stats: merge ``self.grammars.stats()`` (compilations, cache hits, compile seconds, timeouts)
   and ``self.bitmask.stats()`` (mask seconds, steps, rows) into ``LLMEngine.stats()``.
"""

from qworker.engine.structured.bitmask import StructuredBitmask, allowed_tokens
from qworker.engine.structured.compiler import CompileHandle, GrammarCompilerService, compiler_message, make_compile_fn
from qworker.engine.structured.matcher import StructuredState
from qworker.engine.structured.spec import (
    ERROR_CODE,
    GuidedDecodingParams,
    StructuredOutputError,
    StructuredOutputsParams,
    choice_to_ebnf,
)
from qworker.engine.structured.tokenizer_info import build_tokenizer_info, load_tokenizer_info, model_vocab_size

__all__ = [
    "ERROR_CODE",
    "CompileHandle",
    "GrammarCompilerService",
    "GuidedDecodingParams",
    "StructuredBitmask",
    "StructuredOutputError",
    "StructuredOutputsParams",
    "StructuredState",
    "allowed_tokens",
    "build_tokenizer_info",
    "choice_to_ebnf",
    "compiler_message",
    "load_tokenizer_info",
    "make_compile_fn",
    "model_vocab_size",
]
