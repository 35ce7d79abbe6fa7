"""Turn a job record's bytes into a Job, an answerable error, or a DLQ verdict.

Two formats share the jobs topic, told apart by shape: an object with a ``custom_id`` key is an
OpenAI batch request line (its ``custom_id`` is the job id; see ``qworker.openai_batch``),
anything else a native job (its ``id``). Either way a record without a usable id cannot be
answered and goes to the DLQ, and one with a usable id is answered: a job, or an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from qworker.job_ids import usable_id
from qworker.jsonscan import NotJson, scan
from qworker.messages import DECODER_DEPTH, MAX_ID_LEN, Job, bounded_metadata, loads
from qworker.openai_batch.requests import OpenAIRequest, RequestError, is_openai_line, map_line


@dataclass(slots=True)
class Valid:
    job: Job
    wire: OpenAIRequest | None = None  # set: answer in OpenAI's shapes


@dataclass(slots=True)
class Invalid:
    """Parsed JSON with a usable id but breaking the schema: answered with an error message."""

    job_id: str
    message: str
    metadata: dict[str, Any] | None
    code: str = "invalid_job"
    wire: OpenAIRequest | None = None
    param: str | None = None  # the offending field, as the record spelled it
    dead_letter: str | None = None  # also copy the record to the DLQ with this code (too_deep)


@dataclass(slots=True)
class Unparseable:
    """Cannot be answered (no id to key a reply by): goes to the DLQ with these reasons."""

    code: str  # empty | not_json | not_object | no_id | bad_headers (see intake._decode; too_deep: see Invalid)
    message: str


Decoded = Valid | Invalid | Unparseable


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def summarize(err: ValidationError, limit: int = 2000) -> str:
    parts = []
    for e in err.errors(include_url=False, include_input=False):
        loc = ".".join(str(x) for x in e["loc"]) or "job"
        parts.append(f"{loc}: {e['msg']}")
    text = "; ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def decode(value: bytes | None) -> Decoded:
    if not value:
        return Unparseable("empty", "record has no value")
    try:
        data = loads(value)
    except (ValueError, RecursionError) as e:
        return _undecodable(value, e)
    if not isinstance(data, dict):
        return Unparseable("not_object", f"JSON {type(data).__name__}, expected an object")
    if is_openai_line(data):
        return _decode_openai(data)
    if not usable_id(data.get("id")):
        return Unparseable("no_id", f"'id' must be a string of 1-{MAX_ID_LEN} characters")
    try:
        return Valid(Job.model_validate(data))
    except ValidationError as e:
        # echo the metadata only when it is itself valid: it must not make the answer unsendable
        return Invalid(data["id"], summarize(e), bounded_metadata(data.get("metadata")))
    except (ValueError, TypeError, RecursionError) as e:  # pathological input: never kill the worker
        return Invalid(data["id"], f"invalid job: {str(e)[:500]}", None)


def _decode_openai(data: dict[str, Any]) -> Decoded:
    cid = data.get("custom_id")
    if not usable_id(cid):
        return Unparseable("no_id", f"'custom_id' must be a string of 1-{MAX_ID_LEN} characters")
    try:
        job, wire = map_line(data)
    except RequestError as e:
        # the message and param quote the line (a field's name, sometimes its value): bounded, so
        # the error line always fits the size limit (a long field name made one nothing could fit)
        return Invalid(cid, _clip(e.message, 2000), None, e.code, OpenAIRequest(cid), None if e.param is None else _clip(e.param, 300))
    except (ValueError, TypeError, RecursionError) as e:  # pathological input: never kill the worker
        return Invalid(cid, f"invalid request line: {str(e)[:500]}", None, "invalid_job", OpenAIRequest(cid))
    return Valid(job, wire)


def _undecodable(value: bytes, err: BaseException) -> Decoded:
    """The decoders refused ``value``. Valid JSON nested deeper than they go (orjson stops at
    1,024 levels, the stdlib at its recursion limit) still names its job: scanned without
    recursion, a top-level object with a usable id is answered ``invalid_job`` (and copied to
    the DLQ as ``too_deep``); anything else is dead-lettered, as the scan classifies it."""
    try:
        found = scan(value, {"id", "custom_id"})
    except (NotJson, RecursionError, MemoryError):
        return Unparseable("not_json", f"not valid JSON: {str(err)[:500]}")
    if not found.is_object:
        return Unparseable("not_object", f"JSON nests {found.depth} levels deep and is not an object")
    message = f"the job's JSON nests {found.depth} levels deep; the decoder takes at most {DECODER_DEPTH}"
    if "custom_id" in found.fields:  # an OpenAI request line, as is_openai_line tells them apart
        cid = found.fields["custom_id"]
        if not usable_id(cid):
            return Unparseable("no_id", f"'custom_id' must be a string of 1-{MAX_ID_LEN} characters ({message})")
        assert isinstance(cid, str)
        return Invalid(cid, message, None, wire=OpenAIRequest(cid), dead_letter="too_deep")
    jid = found.fields.get("id")
    if not usable_id(jid):
        return Unparseable("no_id", f"'id' must be a string of 1-{MAX_ID_LEN} characters ({message})")
    assert isinstance(jid, str)
    return Invalid(jid, message, None, dead_letter="too_deep")

