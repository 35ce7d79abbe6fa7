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

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_transient_thread(fn: Callable[..., T], *args, name: str = "qworker-start-up") -> T:
    """``fn(*args)`` in a new thread, joined before returning: its result, or its exception
    re-raised here. An exception that interrupts the wait (Ctrl-C's KeyboardInterrupt, a signal
    handler's SystemExit) is raised in the thread as well, which is then waited for, so the work
    stops and cleans up (its ``except``/``finally`` blocks run: a tensor-parallel start-up stops its
    followers) as it did when it ran in the caller's thread; a second interrupt stops waiting. The
    thread is a daemon, so the process never waits for it at exit."""
    box: dict = {}
    done = threading.Event()
    device = _current_cuda_device()

    def target() -> None:
        try:
            if device is not None:  # the current CUDA device is per thread: the caller's choice holds
                import torch

                torch.cuda.set_device(device)
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=target, name=name, daemon=True)
    try:
        thread.start()
        # done.wait(), not thread.join(): an interrupted join marks the thread stopped while it
        # runs on (CPython's bpo-45274 handling), after which join() returns at once
        done.wait()
    except BaseException as interrupt:
        if not done.is_set() and thread.ident is not None:  # raised at its next Python instruction
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(type(interrupt)))
            thread.join()  # to its end, even where the interrupt lands after fn (a second one stops waiting)
        box.clear()  # the interrupt is what the caller sees
        raise
    thread.join()
    error = box.pop("error", None)
    if error is not None:
        # raised without a reference cycle (error -> its traceback -> target's frame -> box ->
        # error, and this frame's `error`): a failed start-up's half-built engine (its weights,
        # a KV cache) is freed once the caller drops the exception, not at the next cyclic GC
        try:
            raise error
        finally:
            del error
    return box.pop("result")


def _current_cuda_device() -> int | None:
    """The caller's current CUDA device where torch is loaded and CUDA started, else None (no
    CUDA initialisation for a CPU caller)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()
