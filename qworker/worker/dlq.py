"""Dead-letter records: the original key, value and headers byte for byte, plus headers saying
why and from where (appended after the original ones)."""

from __future__ import annotations

import json
from collections.abc import Iterable

from qworker.messages import (
    DLQ_HEADER_ERROR,
    DLQ_HEADER_MESSAGE,
    DLQ_HEADER_OFFSET,
    DLQ_HEADER_PARTITION,
    DLQ_HEADER_RAW_HEADERS,
    DLQ_HEADER_TIMESTAMP,
    DLQ_HEADER_TOPIC,
)


def dlq_headers(code: str, message: str, topic: str, partition: int, offset: int, timestamp: int | None) -> list[tuple[str, bytes | None]]:
    return [
        (DLQ_HEADER_ERROR, code.encode()),
        (DLQ_HEADER_MESSAGE, message[:2000].encode("utf-8", "replace")),
        (DLQ_HEADER_TOPIC, topic.encode()),
        (DLQ_HEADER_PARTITION, str(partition).encode()),
        (DLQ_HEADER_OFFSET, str(offset).encode()),
        (DLQ_HEADER_TIMESTAMP, str(timestamp if timestamp is not None else -1).encode()),
    ]


def with_original(original: Iterable[tuple[str, bytes | None]] | None, reasons: list[tuple[str, bytes | None]]) -> list[tuple[str, bytes | None]]:
    """The record's own headers (order, repeats and null values kept), then ours."""
    return [*(original or ()), *reasons]


def raw_headers_header(raw: list[tuple[bytes | None, bytes | None]]) -> tuple[str, bytes]:
    """Headers that cannot be produced again (a key that is not UTF-8, or null), as one JSON
    header: ``[[key hex or null, value hex or null], ...]``."""
    return DLQ_HEADER_RAW_HEADERS, json.dumps([[None if k is None else k.hex(), None if v is None else v.hex()] for k, v in raw]).encode()
