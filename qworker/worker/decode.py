"""Turn a job record's bytes into a Job, an answerable error, or a DLQ verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from qworker.messages import MAX_ID_LEN, Job, bounded_metadata, loads


@dataclass(slots=True)
class Valid:
    job: Job


@dataclass(slots=True)
class Invalid:
    """Parsed JSON with a usable id but breaking the schema: answered with an error message."""

    job_id: str
    message: str
    metadata: dict[str, Any] | None


@dataclass(slots=True)
class Unparseable:
    """Cannot be answered (no id to key a reply by): goes to the DLQ with these reasons."""

    code: str  # empty | not_json | not_object | no_id (bad_headers: see rawfetch)
    message: str


Decoded = Valid | Invalid | Unparseable


def usable_id(value: object) -> bool:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_LEN:
        return False
    try:
        value.encode("utf-8")  # lone surrogates cannot become a Kafka key
    except UnicodeEncodeError:
        return False
    return True


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
        return Unparseable("not_json", f"not valid JSON: {str(e)[:500]}")
    if not isinstance(data, dict):
        return Unparseable("not_object", f"JSON {type(data).__name__}, expected an object")
    if not usable_id(data.get("id")):
        return Unparseable("no_id", f"'id' must be a string of 1-{MAX_ID_LEN} characters")
    try:
        return Valid(Job.model_validate(data))
    except ValidationError as e:
        # echo the metadata only when it is itself valid: it must not make the answer unsendable
        return Invalid(data["id"], summarize(e), bounded_metadata(data.get("metadata")))
    except (ValueError, TypeError, RecursionError) as e:  # pathological input: never kill the worker
        return Invalid(data["id"], f"invalid job: {str(e)[:500]}", None)
