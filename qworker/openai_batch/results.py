"""Native answers -> OpenAI's shapes: batch output lines, ``chat.completion`` /
``text_completion`` bodies, ``chat.completion.chunk`` stream objects.

Invariants:

- One native answer becomes exactly one output line, keyed (by the caller) by the same job id.
- A completion is ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"},
  "error": null}``; an error (a ``JobError``, or a cancelled completion) is ``{"id", "custom_id",
  "response": {"status_code": 4xx|5xx, "request_id", "body": {"error": {message, type, param,
  code}}}, "error": {"code", "message"}}``, the status from ``STATUS``.
- Ids derive from the run: ``batch_req_<run_id>``, ``req_<run_id>``, ``chatcmpl-<run_id>`` /
  ``cmpl-<run_id>``; a streamed run's chunks carry the same body id as its completion, so a
  reader matches chunks to the answer by id (a replayed stream has a fresh run id, hence id).
- Token strings come from a ``TokenText``: the tokenizer's pieces in the worker, or
  ``token_id:<id>`` (vLLM's spelling, no bytes) where no tokenizer is at hand (``collect``
  converting native results).
"""

from __future__ import annotations

import codecs
import uuid
from functools import lru_cache
from typing import Any, Protocol

from qworker.messages import MIN_LOGPROB, Completion, JobError
from qworker.openai_batch.requests import CHAT_FIELDS, COMPLETIONS_FIELDS, OpenAIRequest

# error code -> HTTP status of the output line. Unknown codes: 400 (the engine's
# InvalidRequestError codes are all the request's fault).
STATUS: dict[str, int] = {
    "invalid_job": 400,
    "unsupported_parameter": 400,
    "invalid_sampling": 400,
    "invalid_prompt": 400,
    "empty_prompt": 400,
    "prompt_too_long": 400,
    "invalid_structured_output": 400,
    "wrong_model": 404,
    "model_not_found": 404,  # body.model names no base model or LoRA adapter of a worker serving adapters
    "deadline_exceeded": 408,
    "result_too_large": 413,
    "request_too_large": 413,  # collect only: a file line too large to submit as a job record
    "cancelled": 499,  # the client (a cancel record) closed the request, as nginx's 499
    "internal_error": 500,
    "engine_error": 503,  # retryable: resubmitting may succeed
    "not_answered": 504,  # collect only: no answer before its timeout
}


def status_for(code: str) -> int:
    return STATUS.get(code, 400)


class TokenText(Protocol):
    spells_text: bool  # pieces are the token's text (not a stand-in): text offsets mean something

    def piece(self, token_id: int) -> tuple[str, list[int] | None]:
        """The token's text and its UTF-8 bytes (None when unknown)."""


class IdText:
    """Token strings without a tokenizer: ``token_id:<id>``, bytes unknown."""

    spells_text = False

    def piece(self, token_id: int) -> tuple[str, list[int] | None]:
        return f"token_id:{token_id}", None


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: byte-level BPE spells each byte as one of these
    characters, so a token's exact bytes (a partial UTF-8 character included) are recoverable."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenizerText:
    """Token pieces from a Hugging Face tokenizer, memoised by id. Byte-level BPE pieces give
    exact bytes (``text`` is their UTF-8 decoding, U+FFFD for a partial character, as OpenAI);
    other tokenizers give ``decode([id])`` and its UTF-8 encoding.

    It works on its own copy of the tokenizer, made on first use: the worker encodes prompts
    on other threads, and a fast tokenizer used from two threads at once can raise "Already
    borrowed"."""

    spells_text = True

    def __init__(self, tokenizer: Any):
        self._source = tokenizer
        self._tokenizer: Any = None
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            import copy

            self._tokenizer = copy.deepcopy(self._source)
        return self._tokenizer

    def piece(self, token_id: int) -> tuple[str, list[int] | None]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._piece(token_id)
        return hit

    def _piece(self, token_id: int) -> tuple[str, list[int] | None]:
        try:
            raw = self.tokenizer.convert_ids_to_tokens(token_id)
        except Exception:  # noqa: BLE001 - an id the tokenizer does not know
            raw = None
        table = _byte_decoder()
        if isinstance(raw, str) and raw and all(c in table for c in raw):
            b = bytes(table[c] for c in raw)
            return b.decode("utf-8", "replace"), list(b)
        try:
            text = self.tokenizer.decode([token_id])
        except Exception:  # noqa: BLE001
            return f"token_id:{token_id}", None
        return text, list(text.encode("utf-8", "surrogatepass"))


# ---------------------------------------------------------------------------- bodies
def _usage(u: Any) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def _top(lp: dict[str, float], n: int) -> list[tuple[int, float]]:
    return sorted(((int(k), v) for k, v in lp.items()), key=lambda kv: -kv[1])[:n]


def chat_logprobs(token_ids: list[int], logprobs: list[dict[str, float]], n: int, text: TokenText) -> dict[str, Any]:
    """OpenAI's chat shape: ``content`` holds per token {token, logprob, bytes, top_logprobs}."""
    content = []
    for tid, lp in zip(token_ids, logprobs):
        tok, b = text.piece(tid)
        top = []
        for alt, v in _top(lp, n):
            t, tb = text.piece(alt)
            top.append({"token": t, "logprob": v, "bytes": tb})
        content.append({"token": tok, "logprob": lp.get(str(tid), MIN_LOGPROB), "bytes": b, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: list[int], logprobs: list[dict[str, float]], n: int, text: TokenText) -> dict[str, Any]:
    """The legacy completions shape: parallel ``tokens`` / ``token_logprobs`` /
    ``top_logprobs`` ({token: logprob}) / ``text_offset`` (null when the pieces are stand-ins,
    whose lengths say nothing)."""
    tokens, values, tops = [], [], []
    for tid, lp in zip(token_ids, logprobs):
        tokens.append(text.piece(tid)[0])
        values.append(lp.get(str(tid), MIN_LOGPROB))
        tops.append({text.piece(i)[0]: v for i, v in _top(lp, n)})
    offsets = text_offsets([text.piece(t)[1] for t in token_ids[:len(logprobs)]]) if text.spells_text else None
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def text_offsets(pieces: list[list[int] | None]) -> list[int]:
    """Where each token starts in the text, in characters: the characters its predecessors' bytes
    complete. Counted from bytes, not from each piece decoded alone: a character split over two
    tokens decodes alone as one or two U+FFFD each, which would push every later offset past the
    text (so a token that starts inside a character starts where that character does)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offsets, at = [], 0
    for b in pieces:
        offsets.append(at)
        at += len(decoder.decode(bytes(b or ())))
    return offsets


def body_id(ctx: OpenAIRequest, run_id: str) -> str:
    return ("chatcmpl-" if ctx.endpoint == "chat" else "cmpl-") + (run_id or uuid.uuid4().hex[:16])


def completion_body(msg: Completion, ctx: OpenAIRequest, text: TokenText) -> dict[str, Any]:
    """A ``chat.completion`` or ``text_completion`` object for an ``ok`` completion."""
    choices = []
    for c in msg.choices:
        lp = None
        if ctx.logprobs is not None and c.logprobs is not None:
            shape = chat_logprobs if ctx.endpoint == "chat" else completion_logprobs
            lp = shape(c.token_ids, c.logprobs, ctx.logprobs, text)
        if ctx.endpoint == "chat":
            choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text, "refusal": None}, "logprobs": lp, "finish_reason": c.finish_reason})
        else:
            choices.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
    body: dict[str, Any] = {"id": body_id(ctx, msg.run_id), "object": "chat.completion" if ctx.endpoint == "chat" else "text_completion",
                            "created": ctx.created, "model": msg.model, "choices": choices, "usage": _usage(msg.usage), "system_fingerprint": None}
    if ctx.endpoint == "chat" and ctx.metadata:
        body["metadata"] = ctx.metadata
    return body


# ---------------------------------------------------------------------------- lines
def error_line(custom_id: str, code: str, message: str, run_id: str = "", param: str | None = None) -> dict[str, Any]:
    status = status_for(code)
    rid = run_id or uuid.uuid4().hex[:16]
    err = {"message": message, "type": "invalid_request_error" if status < 500 else "server_error", "param": param, "code": code}
    return {"id": f"batch_req_{rid}", "custom_id": custom_id, "response": {"status_code": status, "request_id": f"req_{rid}", "body": {"error": err}},
            "error": {"code": code, "message": message}}


def output_line(msg: Completion | JobError, ctx: OpenAIRequest, text: TokenText, param: str | None = None) -> dict[str, Any]:
    """The batch output line answering ``msg`` (``param``: the field an error is about; for a
    refusal made after the line was mapped, the field its code points at)."""
    if isinstance(msg, JobError):
        return error_line(ctx.custom_id, msg.error.code, msg.error.message, msg.run_id, param or refused_field(msg.error.code, msg.error.message, ctx))
    if msg.status == "cancelled":  # OpenAI has no "cancelled" finish reason: an error line
        return error_line(ctx.custom_id, "cancelled", "the job was cancelled (a cancel record) before it finished", msg.run_id)
    return {"id": f"batch_req_{msg.run_id}", "custom_id": ctx.custom_id,
            "response": {"status_code": 200, "request_id": f"req_{msg.run_id}", "body": completion_body(msg, ctx, text)}, "error": None}


def refused_field(code: str, message: str, ctx: OpenAIRequest) -> str | None:
    """The body field behind a refusal the engine or the worker makes after mapping the line (the
    line's own checks name theirs): a grammar that does not compile is the response_format's, a
    prompt that cannot run is the messages' (or the prompt's), a sampling refusal the field its
    message starts with (the engine names it first: "logit_bias token ids out of range ...");
    anything else names no one field."""
    if code == "invalid_structured_output":
        return "body.response_format"
    if code in ("prompt_too_long", "empty_prompt", "invalid_prompt"):
        return "body.messages" if ctx.endpoint == "chat" else "body.prompt"
    first = message.split(maxsplit=1)[0] if code == "invalid_sampling" and message.strip() else ""
    return f"body.{first}" if first in (CHAT_FIELDS if ctx.endpoint == "chat" else COMPLETIONS_FIELDS) else None


def run_headers(attempt: int, run_id: str, seq: int | None = None) -> list[tuple[str, bytes]]:
    """Where an OpenAI-shaped record says which run made it (the shapes have no such field)."""
    h = [("qworker.attempt", str(attempt).encode()), ("qworker.run_id", run_id.encode())]
    if seq is not None:
        h.append(("qworker.seq", str(seq).encode()))
    return h


# ---------------------------------------------------------------------------- stream chunks
class ChunkShaper:
    """One run's stream events -> ``chat.completion.chunk`` (chat) or streamed
    ``text_completion`` objects (completions), as OpenAI streams them: the first chunk of each
    choice carries ``role: assistant``; each choice ends with an empty delta carrying its
    ``finish_reason``; with ``include_usage`` a last chunk has no choices and the usage, and
    every other chunk ``usage: null``. Chunks carry ``logprobs: null`` (the output line on the
    completions topic has them). A replay (fresh run id) starts the roles again."""

    def __init__(self, ctx: OpenAIRequest, model: str):
        self.ctx, self.model = ctx, model
        self._run_id = ""
        self._seen: set[int] = set()

    def chunk(self, run_id: str, index: int, text: str, finish_reason: str | None = None, usage: Any = None) -> dict[str, Any]:
        if run_id != self._run_id:
            self._run_id, self._seen = run_id, set()
        chat = self.ctx.endpoint == "chat"
        out: dict[str, Any] = {"id": body_id(self.ctx, run_id), "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": self.ctx.created, "model": self.model, "system_fingerprint": None}
        if usage is not None:
            out["choices"] = []
            out["usage"] = _usage(usage)
            return out
        if chat:
            delta: dict[str, Any] = {} if finish_reason is not None and not text else {"content": text}
            if index not in self._seen:
                delta = {"role": "assistant", **delta} if finish_reason is None else delta
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        self._seen.add(index)
        out["choices"] = [choice]
        if self.ctx.include_usage:
            out["usage"] = None
        return out

