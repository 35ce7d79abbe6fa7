"""Signals: the first SIGTERM/SIGINT starts a graceful drain, a second one stops at once."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)


def install(loop: asyncio.AbstractEventLoop, drain: Callable[[], None], hurry: Callable[[], None]) -> None:
    received = 0

    def handler(sig: signal.Signals) -> None:
        nonlocal received
        received += 1
        if received == 1:
            log.info("%s: draining (finishing in-flight jobs, then committing and leaving the group)", sig.name)
            drain()
        else:
            log.warning("%s again: aborting in-flight jobs now", sig.name)
            hurry()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handler, sig)


def exit_now(code: int) -> None:
    """End the process at once (no unwinding: a thread may be loading weights), logs flushed."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - exiting regardless
            pass
    sys.stderr.flush()
    os._exit(code)
