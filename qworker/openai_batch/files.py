"""JSONL batch files: which lines can be submitted, and the one output line each input line gets.

Invariants:

- Every non-blank input line gets exactly one output line, in input order (blank lines are not
  requests and get none).
- A line is *keyed* when it is a JSON object with a usable id: ``custom_id`` for an OpenAI
  request line, ``id`` for a native job. Keyed lines are submitted even when otherwise invalid:
  the worker is the one judge of validity, and answers them with error lines. Lines that cannot
  be keyed (not JSON, not an object, no usable id) are not submitted (the worker could only
  dead-letter them, and nothing could match its answer to the line); ``collect`` answers them
  locally with an ``invalid_job`` error line whose ``custom_id`` is the line's string
  ``custom_id``/``id`` if it has one (and it is text: no lone surrogate), else ``line-<N>`` (N
  counts lines from 1; ``line-<N>~2`` where another line has ``line-<N>`` for its id). A keyed line
  too large for a job record (``MAX_JOB_RECORD_BYTES``, the submitting producer's limit) is not
  submitted either (the producer would refuse it, and ``collect`` would wait out its timeout
  for it): ``collect`` answers it with a ``request_too_large`` (413) line.
- Native results are converted to OpenAI's shape by the line's form: ``messages`` ->
  ``chat.completion``, ``prompt`` / ``prompt_token_ids`` -> ``text_completion``; their
  logprobs name tokens ``token_id:<id>`` (no tokenizer here), without bytes.
- Of several answers for one id (a rerun after a crash, a resent copy), the highest ``attempt``
  wins, then the latest on the topic.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from qworker.jsonscan import NotJson, scan
from qworker.messages import DECODER_DEPTH, Completion, JobError, loads
from qworker.openai_batch.requests import ENDPOINTS, OpenAIRequest, is_openai_line, looks_like_openai_line
from qworker.openai_batch.results import IdText, error_line, output_line
from qworker.client import MAX_JOB_RECORD_BYTES
from qworker.job_ids import usable_id

_RECORD_OVERHEAD = 256  # a record batch's header and the record's own framing, generously


@dataclass(slots=True)
class InputLine:
    number: int  # 1-based line number in the file
    raw: bytes  # as written, without the line end
    key: str | None = None  # the job id when the line can be submitted
    fmt: Literal["openai", "native"] | None = None
    data: dict[str, Any] | None = None
    problem: str | None = None  # why it cannot be submitted
    code: str = "invalid_job"  # the error code collect answers an unsubmitted line with
    fallback: str | None = None  # the id of a line with none, when ``line-<N>`` is another line's (read_lines)

    @property
    def own_id(self) -> str | None:
        """The id the line gives itself, where usable for an answer (text: no lone surrogate)."""
        if self.key is not None:
            return self.key
        if self.data is not None:
            v = self.data.get("custom_id", self.data.get("id"))
            if isinstance(v, str) and _is_text(v):
                return v
        return None

    @property
    def answer_id(self) -> str:
        """The ``custom_id`` of this line's output line."""
        own = self.own_id
        return own if own is not None else self.fallback or f"line-{self.number}"

    def context(self) -> OpenAIRequest:
        """How to shape a native answer for this line (OpenAI answers come shaped)."""
        d = self.data or {}
        now = int(time.time())  # a native result has no creation time of its own
        if self.fmt == "openai":
            url = d.get("url")
            return OpenAIRequest(self.answer_id, ENDPOINTS.get(url, "chat") if isinstance(url, str) else "chat", created=now)  # type: ignore[arg-type]
        sampling = d.get("sampling") if isinstance(d.get("sampling"), dict) else {}
        lp = sampling.get("logprobs")
        return OpenAIRequest(self.answer_id, "chat" if "messages" in d else "completions", lp if isinstance(lp, int) else None, created=now)


def classify(number: int, raw: bytes) -> InputLine:
    line = InputLine(number, raw)
    try:
        data = loads(raw)
    except (ValueError, RecursionError) as e:
        return _too_deep_or_not_json(line, e)
    if not isinstance(data, dict):
        line.problem = f"a JSON {type(data).__name__}, not an object"
        return line
    line.data = data
    line.fmt = "openai" if is_openai_line(data) else "native"
    # a line shaped as an OpenAI request (method, url, body; no native id) is missing its
    # custom_id, not an id: say the name its author has to add
    field = "custom_id" if line.fmt == "openai" or looks_like_openai_line(data) else "id"
    if not usable_id(data.get(field)):
        line.problem = f"no usable '{field}' (a string of 1-256 characters)"
        return line
    size = len(raw) + len(data[field].encode("utf-8")) + _RECORD_OVERHEAD
    if size > MAX_JOB_RECORD_BYTES:
        line.problem = f"{size} bytes as a record, more than the {MAX_JOB_RECORD_BYTES} a job record may be"
        line.code = "request_too_large"
        return line
    line.key = data[field]
    return line


def _too_deep_or_not_json(line: InputLine, err: BaseException) -> InputLine:
    """The decoder refused the line. Valid JSON nested deeper than it goes (1,024 levels) still
    names its line: read without recursion, its string ``custom_id``/``id`` is the answer's id
    (as the worker, sent such a record, answers it ``invalid_job`` under that id)."""
    try:
        found = scan(line.raw, {"id", "custom_id"})
    except (NotJson, RecursionError, MemoryError):
        line.problem = f"not valid JSON ({str(err)[:200]})"
        return line
    if not found.is_object:
        line.problem = f"a JSON value nested {found.depth} levels deep, not an object"
        return line
    line.data = {k: v for k, v in found.fields.items() if isinstance(v, str)}
    line.problem = f"the JSON nests {found.depth} levels deep; the decoder takes at most {DECODER_DEPTH}"
    return line


def _is_text(s: str) -> bool:
    """No lone surrogate (valid in JSON, not in text: an output line echoing it would not parse)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_lines(content: bytes) -> list[InputLine]:
    """The file's non-blank lines, classified. A line with no id of its own answers as
    ``line-<N>``, or, where another line's id is that, as ``line-<N>~<k>``: one output line per
    id."""
    out = []
    for i, raw in enumerate(content.split(b"\n"), start=1):
        raw = raw.rstrip(b"\r")
        if raw.strip():
            out.append(classify(i, raw))
    taken = {ln.own_id for ln in out} - {None}
    for ln in out:
        if ln.own_id is None and ln.answer_id in taken:
            k = 2
            while f"line-{ln.number}~{k}" in taken:
                k += 1
            ln.fallback = f"line-{ln.number}~{k}"
            taken.add(ln.fallback)
    return out


def local_answer(line: InputLine) -> dict[str, Any]:
    """The error line for a line that was never submitted."""
    return error_line(line.answer_id, line.code, f"line {line.number}: {line.problem}; not submitted")


def attempt_of(value: dict[str, Any], headers: dict[str, bytes]) -> int:
    """A result's attempt: the native field, or the header OpenAI-shaped results carry."""
    if isinstance(value.get("attempt"), int):
        return value["attempt"]
    try:
        return int(headers.get("qworker.attempt", b"0"))
    except (TypeError, ValueError):  # not a number, or a null header value
        return 0


def to_output(line: InputLine, value: dict[str, Any]) -> dict[str, Any]:
    """The output line for ``line`` from the result on the completions topic: OpenAI-shaped
    results as they are (with this line's ``custom_id``), native ones converted."""
    if "custom_id" in value and "response" in value:
        return value if value["custom_id"] == line.answer_id else {**value, "custom_id": line.answer_id}
    try:
        if value.get("type") == "completion":
            msg: Completion | JobError = Completion.model_validate(value)
        else:
            msg = JobError.model_validate(value)
    except ValidationError as e:
        return error_line(line.answer_id, "internal_error", f"unreadable result on the completions topic: {str(e)[:500]}")
    return output_line(msg, line.context(), IdText())


def status_of(out: dict[str, Any]) -> int:
    resp = out.get("response") or {}
    return resp.get("status_code", 500) if isinstance(resp, dict) else 500
