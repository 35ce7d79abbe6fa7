"""Shared helpers for the engine regression tests: a tiny-model engine, bounded stepping and an
injected forward failure (``Faults``)."""

from __future__ import annotations

import threading
import time

import torch

from qworker.engine import EngineConfig, LLMEngine, SamplingParams

BLOCK_BYTES_TINY = 2 * 2 * 16 * 2 * 16 * 4  # layers * (k,v) * block 16 * kv_heads * head_dim * fp32


def engine(tiny_model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 64 * BLOCK_BYTES_TINY)
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), **kw))


def dirty(e: LLMEngine) -> LLMEngine:
    """Fill the KV pool with what earlier requests would have left: reading a block that was
    never written then changes the output (zeros barely do on the random model)."""
    g = torch.Generator().manual_seed(0)
    for k, v in e.runner.kv.layers:
        k.copy_(torch.randn(k.shape, generator=g) * 5)
        v.copy_(torch.randn(v.shape, generator=g) * 5)
    return e


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def rand_ids(rng, n):
    return [rng.randrange(100, 40000) for _ in range(n)]


def run(e, max_steps=3000, max_s=60.0):
    """Steps until done, bounded in steps and time; returns finished requests by id."""
    done = {}
    t0 = time.monotonic()
    for _ in range(max_steps):
        if not e.has_unfinished() or time.monotonic() - t0 > max_s:
            break
        done.update((r.request_id, r) for r in e.step() if r.finished)
    assert not e.has_unfinished(), f"stuck: {sorted(e.requests)} after {e.counters['steps']} steps"
    return done


def outputs(req):
    return [s.output_token_ids for s in sorted(req.seqs, key=lambda s: s.index)]


class Faults:
    """Wraps ``runner.execute``: raises (as a CUDA OOM would) when ``when(batch)`` says so."""

    def __init__(self, e: LLMEngine, when, times: int = 1):
        self.real = e.runner.execute
        self.when = when
        self.left = times
        self.raised = 0
        e.runner.execute = self

    def __call__(self, batch):
        if self.left and self.when(batch):
            self.left -= 1
            self.raised += 1
            raise RuntimeError("CUDA out of memory (injected)")
        return self.real(batch)


class HeldForward:
    """Wraps ``runner.execute`` (of an ``LLMEngine``, or an ``AsyncEngine``'s ``.engine``): only
    ``passes`` forwards return (0: every forward is held; ``free()``: all pass), the next one
    waits until more are allowed. ``entered`` is set whenever a forward starts. Lets a test make
    "the engine is still busy with X when Y happens" a fact instead of a race with the machine's
    speed. ``release()`` lets everything through and unwraps."""

    def __init__(self, e: LLMEngine, passes: float = 0):
        self.runner = e.runner
        self.real = e.runner.execute
        self.passes = passes
        self.entered = threading.Event()
        e.runner.execute = self

    def __call__(self, batch):
        self.entered.set()
        while self.passes <= 0:
            time.sleep(0.01)
        self.passes -= 1
        return self.real(batch)

    def free(self) -> None:
        self.passes = float("inf")

    def release(self) -> None:
        self.free()
        self.runner.execute = self.real


class EngineClock:
    """Stands in for ``qworker.engine.llm_engine``'s ``time`` module (``monkeypatch.setattr(
    llm_engine, "time", clock)``): ``time()`` is the real time plus ``offset``, so a test moves
    the engine past a deadline without sleeping, while everything else keeps real time."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset

    def __getattr__(self, name: str):
        return getattr(time, name)
