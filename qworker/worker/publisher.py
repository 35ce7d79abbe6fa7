"""Publishing results: acks=all, compression, and a delivery check before any offset moves."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

log = logging.getLogger(__name__)


class DeliveryAborted(Exception):
    """The worker is stopping and the message was never acknowledged: do not commit its offset."""


class Publisher:
    """Wraps the producer. ``deliver`` retries until the broker acknowledges (e.g. through a
    broker outage) or the worker gives up at shutdown; only then may the job's offset move."""

    def __init__(self, producer: AIOKafkaProducer, giving_up: Callable[[], bool]):
        self.producer = producer
        self.giving_up = giving_up
        self.sent = 0
        self.failures = 0

    async def send(self, topic: str, key: str, value: bytes, headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future:
        """Enqueue one message; the returned future resolves when the broker acknowledged it.
        Messages with one key go to one partition in send order (aiokafka keeps one batch in
        flight per partition), so a job's stream events and completion stay ordered."""
        fut = await self.producer.send(topic, value=value, key=key.encode("utf-8"), headers=headers)
        self.sent += 1
        return fut

    async def deliver(self, topic: str, key: str, value: bytes, headers: list[tuple[str, bytes]] | None = None) -> None:
        """Send and wait for the acknowledgement, retrying with backoff; raises DeliveryAborted."""
        backoff = 0.1
        while True:
            try:
                fut = await self.send(topic, key, value, headers)
                await fut
                return
            except KafkaError as e:
                self.failures += 1
                if self.giving_up():
                    raise DeliveryAborted(f"{topic}/{key}: {e!r}") from e
                log.warning("delivery to %s failed (%r); retrying in %.1fs", topic, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def settle(self, topic: str, key: str, sent: list[tuple[bytes, asyncio.Future]]) -> None:
        """Wait for a batch of earlier sends; resend the ones that failed (readers order by seq)."""
        for value, fut in sent:
            try:
                await fut
            except KafkaError:
                self.failures += 1
                await self.deliver(topic, key, value)
