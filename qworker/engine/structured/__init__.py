"""Structured output: JSON schema, JSON object, regex, choice or EBNF grammar, via xgrammar.

Phase 1 (this package) is standalone: spec (``spec.py``), tokenizer info (``tokenizer_info.py``),
compiler service (``compiler.py``: the cache and single flight; ``compile_pool.py`` and
``compile_child.py``: compile processes that a timeout kills; ``grammar_check.py``: a grammar with
no finite output is refused), per-sequence state (``matcher.py``), batched mask
(``bitmask.py``). Phase 2 wires it into the engine in these steps.

0. Fields: ``SamplingParams.structured_outputs: StructuredOutputsParams | None = None`` (vLLM's
   name since 0.10.2; ``GuidedDecodingParams`` is kept as an alias of the type);
   ``Request.grammar: CompileHandle | None = None``; ``Sequence.structured: StructuredState |
   None = None`` (both dataclasses have slots: the fields must be declared). The spec validates
   itself at construction and raises ``StructuredOutputError`` (an ``InvalidRequestError``, code
   ``invalid_structured_output``); ``SamplingParams.validate`` only checks the type. The
   worker turns a job's ``response_format`` into one with ``from_response_format(rf)``.
1. ``LLMEngine.__init__``: ``self.tokenizer_info = build_tokenizer_info(self.tokenizer,
   self.vocab_size, self.eos_token_ids)`` (the logits width, not ``len(tokenizer)``; the engine's
   EOS set becomes the grammar's stop tokens; special tokens are blanked so the grammar never
   allows one); ``self.grammars = GrammarCompilerService(self.tokenizer_info, cache_size=...,
   cache_max_bytes=..., timeout_s=..., max_workers=...)`` (compile processes, a byte-bounded cache); ``self.bitmask = StructuredBitmask(self.vocab_size,
   self.runner.device)``.
2. Admission (worker thread, before the job takes engine time):
   ``engine.grammars.validate(spec)`` (blocking; e.g. ``await asyncio.to_thread(...)``) raises
   ``StructuredOutputError`` for a bad spec or a compile past the timeout; the worker already
   maps ``InvalidRequestError`` to a non-retryable error carrying ``e.code`` and the message.
3. ``add_request``: ``req.grammar = self.grammars.submit(spec, admitted=True)`` (a cache hit
   after validate, not counted twice; ``admitted=False`` when nothing validated it) and the
   request joins ``self._compiling``.
4. Waiting for the grammar (vLLM's WAITING_FOR_FSM): at the top of ``LLMEngine.step()``, for each
   request in ``_compiling`` whose ``req.grammar.done``: ``req.grammar.error`` ->
   ``abort(request_id, error=...)`` reporting ``invalid_structured_output``; else
   ``req.seqs[0].structured = StructuredState(req.grammar.result())``. In
   ``Scheduler._admit_waiting``, first thing in the loop: ``if seq.request.grammar is not None
   and seq.structured is None: continue`` (``continue``, not ``break``: the rest of the queue is
   admitted; no budget or blocks are taken). ``LLM.generate`` and ``AsyncEngine``'s thread call
   ``step()`` while ``has_unfinished()``, so a step whose schedule is empty while ``_compiling``
   is not should ``_compiling[0].grammar.wait(0.005)`` rather than return at once (no busy loop).
5. Fork (``n > 1``, in ``_update`` after ``child = self._new_seq(req, i)``):
   ``child.structured = seq.structured.fork()`` (a deep copy: each child its own parse state).
6. Sampler: ``sample(..., bitmask: StructuredBitmask | None = None)``; first lines:
   ``constrained = [(i, s.structured) for i, s in enumerate(seqs) if s.structured is not None]``
   then ``bitmask.apply(logits, constrained)`` in place, before ``raw = logits``: logprobs are
   then those of the masked distribution (what vLLM returns: its bitmask is applied before its
   sampler computes logprobs), and every sampled token fits. Rows are the sampling rows (forks
   already have their own repeated row). The ``min_tokens`` EOS ban skips a row whose
   ``seq.structured.is_completed()`` (the grammar wins; otherwise a row that may only stop would
   be all ``-inf``). Seeded rows keep one exponential draw per vocabulary entry, so seeded
   constrained sampling stays batch-independent. Optional overlap: ``fut =
   bitmask.start_fill(num_rows, constrained)`` before ``runner.execute`` and
   ``bitmask.apply(logits, constrained, filled=fut)`` after (rows must be the same; a fresh
   fork's rows are filled synchronously instead).
7. ``_update`` (the only mutation point), after ``seq.token_ids.append(token)``:
   ``if seq.structured is not None and not seq.structured.accept(token)`` -> finish ABORT (cannot
   happen after a mask; a guard). ``_stop_reason``, right after the stop-string check:
   ``if seq.structured is not None and seq.structured.is_terminated(): return STOP, None``
   (before the ``ignore_eos`` test: a finished grammar ends the sequence). ``max_tokens`` gives
   ``length`` with a valid prefix. A stop string can end a constrained output early ("stop" but
   incomplete): document it, or ignore ``stop`` for constrained jobs.
8. Preemption: recompute keeps ``token_ids`` and the state; the scheduler only samples once the
   sequence has caught up with its last token, so nothing is re-sampled or re-accepted. Swap keeps
   it too. Anything that rebuilds a sequence from tokens uses
   ``StructuredState.replay(grammar, seq.output_token_ids)``.
9. Abort needs nothing: a handle nobody holds is dropped, and a queued compile whose every
   handle is gone is never started. A compile past its budget (counted from its start) has its
   process killed; see ``compiler.py`` and ``compile_pool.py``.
10. Stats: merge ``self.grammars.stats()`` (``grammar_compilations``, ``grammar_cache_hits``,
    ``grammar_compile_seconds``, ``grammar_compile_timeouts``, ...) and ``self.bitmask.stats()``
    (``mask_seconds``, ``mask_steps``, ``masked_rows``) into ``LLMEngine.stats()``.
"""

from qworker.engine.structured.bitmask import StructuredBitmask, allowed_tokens
from qworker.engine.structured.compiler import DEFAULT_CACHE_BYTES, CompileHandle, CompilerUnavailable, GrammarCompilerService, compiler_message
from qworker.engine.structured.matcher import StructuredState
from qworker.engine.structured.spec import (
    ERROR_CODE,
    GuidedDecodingParams,
    StructuredOutputError,
    StructuredOutputsParams,
    choice_to_ebnf,
    from_response_format,
)
from qworker.engine.structured.tokenizer_info import build_tokenizer_info, load_tokenizer_info, model_vocab_size

__all__ = [
    "ERROR_CODE",
    "CompileHandle",
    "CompilerUnavailable",
    "DEFAULT_CACHE_BYTES",
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
    "from_response_format",
    "load_tokenizer_info",
    "model_vocab_size",
]
