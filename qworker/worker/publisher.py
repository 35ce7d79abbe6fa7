"""Publishing results: acks=all, compression, and a delivery check before any offset moves."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    TopicAuthorizationFailedError,
)
from aiokafka.record.default_records import DefaultRecordBatchBuilder

log = logging.getLogger(__name__)

Key = str | bytes | None
Headers = list[tuple[str, bytes | None]] | None

# A resend cannot fix these: the broker (or the client's own size check) refuses this record.
# Everything else (timeouts, a full buffer, lost connections, leader moves) is transient.
PERMANENT_ERRORS = (
    MessageSizeTooLargeError,
    RecordTooLargeError,
    RecordListTooLargeError,
    InvalidTopicError,
    TopicAuthorizationFailedError,
    ClusterAuthorizationFailedError,
)


class DeliveryAborted(Exception):
    """The worker is stopping and the message was never acknowledged: do not commit its offset."""


class DeliveryRefused(Exception):
    """The broker (or the producer's size check) refuses the record for good: retrying would
    block the job's partition forever. The caller publishes a small error in its place when
    ``too_large``; otherwise (topic missing, not authorised) nothing can be published."""

    def __init__(self, message: str, too_large: bool):
        super().__init__(message)
        self.too_large = too_large


def record_size(key: Key, value: bytes | None, headers: Headers) -> int:
    """The record's size as the producer's ``max_request_size`` check counts it (uncompressed)."""
    kb = key.encode("utf-8") if isinstance(key, str) else key
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(kb, value, headers or [])


class Publisher:
    """Wraps the producer. ``deliver`` retries transient errors until the broker acknowledges
    (e.g. through a broker outage or stall) or the worker gives up at shutdown; only then may
    the job's offset move. Permanent errors raise ``DeliveryRefused`` at once."""

    def __init__(self, producer: AIOKafkaProducer, giving_up: Callable[[], bool], max_message_bytes: int = 1_000_000):
        self.producer = producer
        self.giving_up = giving_up
        self.max_message_bytes = max_message_bytes
        self.sent = 0
        self.failures = 0

    def fits(self, key: Key, value: bytes | None, headers: Headers = None) -> bool:
        return record_size(key, value, headers) <= self.max_message_bytes

    async def wait_retry(self, what: str, e: BaseException, backoff: float, key: Key = None) -> float:
        """Back off after a failed delivery to ``what`` (raises when it can never succeed or the
        worker gives up). ``key``: the record's, named as the job on the log line when it is one
        (answers and stream events are keyed by job id)."""
        self.failures += 1
        if isinstance(e, PERMANENT_ERRORS):
            too_large = isinstance(e, (MessageSizeTooLargeError, RecordTooLargeError, RecordListTooLargeError))
            raise DeliveryRefused(f"{what}: {e!r}", too_large) from e
        if self.giving_up():
            raise DeliveryAborted(f"{what}: {e!r}") from e
        log.warning("delivery to %s failed (%r); retrying in %.1fs", what, e, backoff, extra={"job_id": key} if isinstance(key, str) else None)
        await asyncio.sleep(backoff)
        return min(backoff * 2, 2.0)

    async def send(self, topic: str, key: Key, value: bytes | None, headers: Headers = None) -> asyncio.Future:
        """Enqueue one message; the returned future resolves when the broker acknowledged it.
        Enqueueing itself is retried: aiokafka raises ``KafkaTimeoutError`` when its buffer stays
        full (a stalled broker), and the message must not be lost for that. Messages with one
        key go to one partition in send order (aiokafka keeps one batch in flight per
        partition), so a job's stream events and completion stay ordered."""
        kb = key.encode("utf-8") if isinstance(key, str) else key
        if not self.fits(kb, value, headers):
            raise DeliveryRefused(f"{topic}: record of {record_size(kb, value, headers)} bytes exceeds max_message_bytes={self.max_message_bytes}", True)
        backoff = 0.1
        while True:
            try:
                if kb is None and value is None:
                    fut = await self._send_null(topic, headers)
                else:
                    fut = await self.producer.send(topic, value=value, key=kb, headers=headers)
            except KafkaError as e:
                backoff = await self.wait_retry(topic, e, backoff, key)
                continue
            self.sent += 1
            return fut

    async def _send_null(self, topic: str, headers: Headers) -> asyncio.Future:
        """A record with null key and null value (``producer.send`` refuses one; a DLQ copy of
        such a record must keep both null)."""
        parts = sorted(await self.producer.partitions_for(topic))
        batch = self.producer.create_batch()
        batch.append(key=None, value=None, timestamp=None, headers=headers or [])
        batch.close()
        return await self.producer.send_batch(batch, topic, partition=parts[0])

    async def deliver(self, topic: str, key: Key, value: bytes | None, headers: Headers = None) -> None:
        """Send and wait for the acknowledgement, retrying with backoff; raises DeliveryAborted
        (stopping) or DeliveryRefused (never deliverable)."""
        backoff = 0.1
        while True:
            fut = await self.send(topic, key, value, headers)
            try:
                await fut
                return
            except KafkaError as e:
                backoff = await self.wait_retry(topic, e, backoff, key)
