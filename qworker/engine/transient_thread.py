"""Run start-up work in a thread that ends before the caller goes on.

Why: libgomp (torch's OpenMP runtime, which qworker's C kernels share) keeps a pool of worker
threads for every thread that has run a parallel region, until that thread ends. When the pools
hold more threads than the machine has CPUs, libgomp stops spin-waiting between regions (its
"throttled" spin count: 100 iterations instead of 300,000), so every parallel region pays a
futex wake-up of its workers. Engine start-up runs parallel regions (weight packing, the GEMM
self-checks and probes); run in the caller's thread, they leave a pool there, and an engine then
stepped in another thread (``AsyncEngine``: the worker) ran each GEMM up to 2x slower and the
48-request bf16 run 1.3x slower on a 2-vCPU Sapphire Rapids (docs/benchmarks.md). Started here,
the start-up's pool ends with its thread, and the thread that steps the engine holds the only one
(as long as no other thread runs parallel torch work at the same time).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_transient_thread(fn: Callable[..., T], *args, name: str = "qworker-start-up") -> T:
    """``fn(*args)`` in a new thread, joined before returning: its result, or its exception
    re-raised here. The thread is a daemon, so a signal that ends the caller while it waits
    (Ctrl-C, the worker's SIGTERM) does not leave the process waiting for it."""
    box: dict = {}

    def target() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
