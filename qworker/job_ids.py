"""The job-id rule, shared by the worker (decoding records) and the producers (CLI, batch files).

A record's id is its OpenAI line's ``custom_id`` or its native job's ``id``; an id is usable as
a Kafka key and a dedupe key when it is a non-empty string of at most ``MAX_ID_LEN`` characters
that encodes as UTF-8. It sits below ``worker/`` and ``openai_batch/`` so neither imports the other.
"""

from __future__ import annotations

from qworker.messages import MAX_ID_LEN


def is_openai_line(data: object) -> bool:
    """The two formats are told apart by shape: a JSON object with a ``custom_id`` key is an
    OpenAI batch request line (native jobs reject unknown keys, so none carries one)."""
    return isinstance(data, dict) and "custom_id" in data


def usable_id(value: object) -> bool:
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_LEN:
        return False
    try:
        value.encode("utf-8")  # lone surrogates cannot become a Kafka key
    except UnicodeEncodeError:
        return False
    return True
