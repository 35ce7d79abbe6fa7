"""Adversarial checks of qworker/engine/transient_thread.py (engine start-up and LoRA loads in a
thread that ends).

Defects these tests pin down (each failed on e40d26d):

* A failed start-up's half-built engine (its weights, on a GPU its memory) outlived the exception:
  ``box["error"]`` -> the exception's traceback -> ``target``'s frame -> its ``box`` cell -> the
  exception is a reference cycle, so nothing in it was freed until a cyclic GC ran.
* Ctrl-C during ``LLM(...)``: the KeyboardInterrupt interrupted only the caller's ``join``; the
  start-up ran on in its daemon thread. Caught (a REPL keeps it as ``sys.last_value``), the engine
  was then finished in the background and kept alive by the traceback, tensor-parallel followers
  included; not caught, the interpreter finalized while the thread was inside torch, and the
  process died of SIGABRT ("terminate called without an active exception", exit status 134)
  instead of exiting with the KeyboardInterrupt (130). In the caller's thread the interrupt
  stopped the start-up and its ``except BaseException`` blocks cleaned up.

Held, and kept as guards: results, exceptions (KeyboardInterrupt and SystemExit raised inside
included) and their tracebacks reach the caller."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import pytest

from qworker.engine.transient_thread import in_transient_thread

ROOT = Path(__file__).resolve().parents[2]


def test_results_and_exceptions_raised_inside_reach_the_caller():
    assert in_transient_thread(lambda a, b: a + b, 2, 3) == 5
    for exc in (KeyboardInterrupt, SystemExit, ValueError):
        def fails(exc=exc):
            raise exc("inside")

        with pytest.raises(exc, match="inside") as info:
            in_transient_thread(fails)
        assert any(f.name == "fails" for f in info.traceback)


def test_a_failed_start_ups_objects_are_freed_without_a_cyclic_gc():
    class HalfBuilt:  # stands in for the weights and caches a failed start-up had made
        pass

    refs = []

    def start():
        obj = HalfBuilt()
        refs.append(weakref.ref(obj))
        raise MemoryError("the KV cache does not fit")

    was_enabled = gc.isenabled()
    gc.disable()
    try:
        try:
            in_transient_thread(start)
        except MemoryError:
            pass
        assert refs[0]() is None, "the failed start-up's objects are held by a reference cycle"
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread only")
def test_an_interrupt_while_waiting_stops_the_work_before_the_caller_goes_on():
    """SIGINT while the caller waits: the work sees the KeyboardInterrupt too (its cleanup runs),
    and it has ended when the caller gets the KeyboardInterrupt."""
    import time

    events = []
    started = threading.Event()

    def work():
        started.set()
        deadline = time.monotonic() + 5  # bounded: where the interrupt does not reach it, it ends anyway
        try:
            while time.monotonic() < deadline:  # start-up work, in Python between C calls
                sum(range(1000))
        except KeyboardInterrupt:
            events.append("work interrupted")
            raise
        finally:
            events.append("work cleaned up")

    # once the work runs and the caller waits for it; SIGINT raising KeyboardInterrupt, as in a
    # terminal, whatever this process inherited (a background job of a non-interactive shell,
    # as CI may start it, has SIGINT ignored, and Python then installs no handler)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.0, lambda: (started.wait(10), time.sleep(0.2), os.kill(os.getpid(), signal.SIGINT)))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            in_transient_thread(work, name="attack-start-up")
        assert events == ["work interrupted", "work cleaned up"]
        assert not any(t.name == "attack-start-up" for t in threading.enumerate())
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_start_up_exits_with_the_interrupt_not_an_abort():
    """A script interrupted while its start-up thread is inside torch (not caught): exit status
    130 with the KeyboardInterrupt, as when start-up ran in the caller's thread; not SIGABRT from a
    daemon thread ended by interpreter finalization in the middle of a C++ call."""
    script = textwrap.dedent("""
        import os, signal, threading, torch
        from qworker.engine.transient_thread import in_transient_thread
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, whatever was inherited
        torch.set_num_threads(2)
        def work():
            a = torch.randn(512, 512)
            for _ in range(400):
                a = torch.tanh(a @ a / 512)
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        in_transient_thread(work)
    """)
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert "terminate called" not in out.stderr, out.stderr[-1000:]
        assert out.returncode in (1, 130, -signal.SIGINT), (out.returncode, out.stderr[-1000:])
        assert "KeyboardInterrupt" in out.stderr
