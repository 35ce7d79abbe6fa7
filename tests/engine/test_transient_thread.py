"""Start-up work runs in a thread that ends, so its OpenMP pool does not stay in the caller's thread
(where it would throttle the parallel regions of the thread that steps the engine: see
qworker/engine/transient_thread.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from qworker.engine.transient_thread import in_transient_thread

ROOT = Path(__file__).resolve().parents[2]


def test_result_exception_and_the_thread_it_ran_in():
    seen = []

    def work(x):
        seen.append(threading.current_thread())
        return x * 2

    assert in_transient_thread(work, 21) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()

    def fails():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        in_transient_thread(fails)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU: OpenMP runs no pool threads")
def test_the_openmp_pool_ends_with_the_thread():
    """Counted in a fresh process: a parallel torch op run through in_transient_thread leaves no
    threads behind; the same op run directly leaves its pool (the control: the count can grow)."""
    script = """
import os, time, torch
from qworker.engine.transient_thread import in_transient_thread
torch.set_num_threads(2)
def work():
    a = torch.randn(1024, 1024)
    for _ in range(3):
        a = torch.tanh(a @ a / 1024)
def threads():
    return len(os.listdir('/proc/self/task'))
def settled(want, timeout=5.0):  # pool threads end a moment after their thread
    end = time.monotonic() + timeout
    while threads() != want and time.monotonic() < end:
        time.sleep(0.01)
    return threads()
before = threads()
in_transient_thread(work)
after_transient = settled(before)
work()
print(before, after_transient, settled(-1, timeout=0.5))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    before, after_transient, after_direct = map(int, out.stdout.split())
    assert after_transient == before
    assert after_direct > before


def test_the_engine_starts_in_a_thread_of_its_own(tiny_model_dir, monkeypatch):
    from qworker.engine import llm_engine
    from qworker.engine.config import EngineConfig

    threads = []
    real = llm_engine.LLMEngine._start

    def spy(self, config):
        threads.append(threading.current_thread())
        real(self, config)

    monkeypatch.setattr(llm_engine.LLMEngine, "_start", spy)
    e = llm_engine.LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=4 << 20))
    assert threads and threads[0] is not threading.current_thread() and not threads[0].is_alive()
    assert e.max_model_len > 0


def test_the_callers_cuda_device_holds_in_the_thread(monkeypatch):
    """The current CUDA device is per thread: a caller that chose device 3 must get its engine
    built there. (No GPU here: torch.cuda's device queries are stood in for; the thread's
    set_device call is what is checked.)"""
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((d, threading.current_thread())))
    assert in_transient_thread(lambda: "built") == "built"
    assert len(calls) == 1 and calls[0][0] == 3 and calls[0][1] is not threading.current_thread()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # a CPU caller: CUDA is not started
    in_transient_thread(lambda: None)
    assert len(calls) == 1
