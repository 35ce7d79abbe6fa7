"""Dead-letter records: the original key and bytes, plus headers saying why and from where."""

from __future__ import annotations

from qworker.messages import (
    DLQ_HEADER_ERROR,
    DLQ_HEADER_MESSAGE,
    DLQ_HEADER_OFFSET,
    DLQ_HEADER_PARTITION,
    DLQ_HEADER_TIMESTAMP,
    DLQ_HEADER_TOPIC,
)


def dlq_headers(code: str, message: str, topic: str, partition: int, offset: int, timestamp: int | None) -> list[tuple[str, bytes]]:
    return [
        (DLQ_HEADER_ERROR, code.encode()),
        (DLQ_HEADER_MESSAGE, message.encode("utf-8", "replace")),
        (DLQ_HEADER_TOPIC, topic.encode()),
        (DLQ_HEADER_PARTITION, str(partition).encode()),
        (DLQ_HEADER_OFFSET, str(offset).encode()),
        (DLQ_HEADER_TIMESTAMP, str(timestamp if timestamp is not None else -1).encode()),
    ]
