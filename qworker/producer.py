"""Starting a Kafka producer, with a fallback for brokers that refuse idempotence.

An idempotent producer starts with InitProducerId. Real Kafka grants it; the bundled Tansu
broker (and some managed brokers without the IDEMPOTENT_WRITE permission) answer with an
error, which aiokafka raises from ``start()`` as a bare ``UnknownError``. qworker's delivery is
at-least-once either way (readers deduplicate by job id), so rather than die on a new user's
first ``qworker run`` the producer is started again without idempotence, and one warning says
what that costs and how to skip the attempt. A broker that cannot be reached at all is not
this case: ``KafkaConnectionError`` propagates (the worker turns it into a one-line exit 2).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaConnectionError, KafkaError

log = logging.getLogger("qworker.producer")

FALLBACK_WARNING = (
    "the broker refused an idempotent producer (InitProducerId failed: %r); continuing without idempotence: "
    "a result resent after a lost acknowledgement may then appear twice (same job id and run_id, readers keep one). "
    "Set QWORKER_ENABLE_IDEMPOTENCE=false to skip the attempt (Tansu, the bundled broker, never grants it)."
)


@contextlib.contextmanager
def _quiet_sender() -> Iterator[None]:
    """aiokafka logs the refused InitProducerId at ERROR before raising; the one warning below
    says it better, so that line is held back while the idempotent start is tried."""
    sender = logging.getLogger("aiokafka.producer.sender")
    level = sender.level
    sender.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        sender.setLevel(level)


async def start_producer(options: dict[str, Any]) -> AIOKafkaProducer:
    """A started producer for ``options``; falls back to ``enable_idempotence=False`` (with a
    warning) when the broker refuses the idempotent start. Never leaves a half-started one."""
    p = AIOKafkaProducer(**options)
    try:
        with _quiet_sender() if options.get("enable_idempotence") else contextlib.nullcontext():
            await p.start()
        return p
    except KafkaConnectionError:
        with contextlib.suppress(Exception):
            await p.stop()
        raise
    except KafkaError as e:
        with contextlib.suppress(Exception):
            await p.stop()
        if not options.get("enable_idempotence"):
            raise
        log.warning(FALLBACK_WARNING, e)
    p = AIOKafkaProducer(**{**options, "enable_idempotence": False})
    try:
        await p.start()
    except BaseException:
        with contextlib.suppress(Exception):
            await p.stop()
        raise
    return p
