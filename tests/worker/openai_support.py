"""Checks that qworker's OpenAI-shaped records are what the ``openai`` package's own types read.

The SDK's models allow extra fields (``extra="allow"``), so validating alone would accept any
stray key; ``strict`` also walks the parsed object and fails on a field the type does not
declare. openai 3.57 ships no type for a batch *output* line, so ``BatchOutputLine`` spells the
documented shape (``{"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error": {"code", "message"} | null}``) with extra fields forbidden.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk


def assert_no_extra(obj: Any, path: str = "") -> None:
    if isinstance(obj, BaseModel):
        extra = obj.model_extra or {}
        assert not extra, f"{path or type(obj).__name__}: fields the openai type does not declare: {sorted(extra)}"
        for name in type(obj).model_fields:
            assert_no_extra(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            assert_no_extra(x, f"{path}[{i}]")


def strict(cls: type[BaseModel], data: dict) -> Any:
    obj = cls.model_validate(data)
    assert_no_extra(obj, cls.__name__)
    return obj


class _Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class BatchOutputError(_Forbid):
    code: str
    message: str


class BatchOutputResponse(_Forbid):
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchOutputLine(_Forbid):
    id: str
    custom_id: str
    response: BatchOutputResponse | None
    error: BatchOutputError | None


class ErrorObject(_Forbid):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(_Forbid):
    error: ErrorObject


def validate_line(line: dict) -> ChatCompletion | Completion | ErrorBody:
    """One batch output line: a 200 with a chat.completion / text_completion body and no error,
    or a 4xx/5xx with an OpenAI error body and the same code in ``error``."""
    out = BatchOutputLine.model_validate(line)
    assert out.response is not None
    if out.response.status_code == 200:
        assert out.error is None
        kind = out.response.body.get("object")
        assert kind in ("chat.completion", "text_completion"), kind
        return strict(ChatCompletion if kind == "chat.completion" else Completion, out.response.body)
    assert 400 <= out.response.status_code < 600 and out.error is not None, line
    body = ErrorBody.model_validate(out.response.body)
    assert body.error.code == out.error.code and body.error.message == out.error.message
    return body


def validate_chunk(obj: dict) -> ChatCompletionChunk | Completion:
    """A streamed chunk: ``chat.completion.chunk``, or a streamed ``text_completion``. OpenAI
    streams the latter with ``finish_reason: null`` until the last chunk, which the SDK's
    ``Completion`` (shared by both) declares non-null: those are checked with it set."""
    if obj.get("object") == "chat.completion.chunk":
        return strict(ChatCompletionChunk, obj)
    assert obj.get("object") == "text_completion", obj
    patched = {**obj, "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"} for c in obj["choices"]]}
    return strict(Completion, patched)
