"""Structured output: JSON schema, JSON object, regex, choice or EBNF grammar, via xgrammar.

The pieces: the spec (``spec.py``: ``StructuredOutputsParams``, validated at construction, a bad
one raises ``StructuredOutputError``, an ``InvalidRequestError`` with code
``invalid_structured_output``; non-local ``$ref`` is refused, nothing is ever fetched), tokenizer
info (``tokenizer_info.py``: the logits width; the engine's EOS set becomes the grammar's stop
tokens), the compiler service (``compiler.py``: a byte-bounded cache and one compile per
distinct spec in flight; ``compile_pool.py`` / ``compile_child.py``: compile processes forked
from one zygote, killed when a compile runs past its budget counted from its start;
``grammar_check.py``: a grammar with no finite output is refused), per-sequence parse state
(``matcher.py``) and the batched token mask (``bitmask.py``).

The engine's collaborator is ``outputs.StructuredOutputs`` (compiles, the wait for them, each
step's masks). The invariants it keeps with the rest of the engine:

- A request waits unscheduled until its grammar is compiled (the scheduler skips it; the rest of
  the queue is admitted); a step with nothing else to do sleeps on the compile, not in a loop.
- The mask is applied before logprobs are taken (vLLM's order), so every sampled token fits and
  logprobs are those of the masked distribution; a ``min_tokens`` EOS ban yields to a grammar
  that may only stop. Seeded rows keep one draw per vocabulary entry (batch-independent).
- The parse state moves only in the step's update, together with ``token_ids``: a failed step, a
  recompute or a swap leaves both consistent; ``n > 1`` forks deep-copy it.
- A terminated grammar finishes its sequence with "stop"; a refused spec or a compile past its
  budget finishes the request with ``invalid_structured_output`` (the job's fault); a compile no
  process could run finishes it with ``engine_error`` (ours, retryable).
- Abort needs nothing: a compile whose every waiter is gone is never started.
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
