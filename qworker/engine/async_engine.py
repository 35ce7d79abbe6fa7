"""``AsyncEngine``: the engine for asyncio callers (the Kafka worker).

The engine steps in its own thread; the event loop only enqueues commands and receives outputs,
so it never waits longer than it takes to hand over a step's outputs. Each ``generate()`` call is
an async generator of deltas; closing or cancelling it aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator

from qworker.engine.config import EngineConfig
from qworker.engine.llm_engine import Capacity, LLMEngine, Prompt
from qworker.engine.output_processor import delta_output, final_output
from qworker.engine.outputs import RequestOutput
from qworker.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self.last_step_time = time.monotonic()
        self.ready = False
        self.step_error: BaseException | None = None
        # snapshots written by the engine thread, read by the loop: the loop never walks the
        # scheduler's queues while the engine thread changes them
        self._capacity = engine.capacity()
        self._stats = engine.stats()

    @classmethod
    def from_model(cls, model_dir: str, **engine_config) -> AsyncEngine:
        return cls(LLMEngine(EngineConfig.from_kwargs(model_dir, **engine_config)))

    # -- facts the worker needs ------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def encode(self, prompt: Prompt) -> list[int]:
        return self.engine.encode(prompt)

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.check(prompt_token_ids, params)

    def capacity(self) -> Capacity:
        """As of the last step (or the last command the engine thread took)."""
        return self._capacity

    def stats(self) -> dict:
        """As of the last step; a copy the caller may keep."""
        return dict(self._stats)

    def _snapshot(self) -> None:
        self._capacity = self.engine.capacity()
        self._stats = self.engine.stats()

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="qworker-engine", daemon=True)
        self._thread.start()
        self.ready = True

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._commands.put(("stop", None))
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.ready = False

    # -- requests ----------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, *,
                       deadline: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yields deltas until the request finishes. Raises ``InvalidRequestError`` at once for a
        request that can never run, ``ValueError`` for a request id already in flight.
        ``deadline`` (``time.time()``): see ``LLMEngine.add_request``; an expired request's one
        output has finish_reason "abort" and ``error_code`` "deadline_exceeded"."""
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already in flight")
        ids = self.engine.encode(prompt)
        self.engine.check(ids, params)
        loop = asyncio.get_running_loop()
        out_q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, out_q)
        self._commands.put(("add", (request_id, ids, params, priority, deadline, prompt if isinstance(prompt, str) else None)))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await out_q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # -- the engine thread -------------------------------------------------------------------------
    def _emit(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_commands(self) -> bool:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                for rid in list(self.engine.requests):
                    self._abort(rid)
                return False
            if kind == "add":
                rid, ids, params, priority, deadline, text = arg
                try:
                    req = self.engine.add_request(rid, ids, params, priority, deadline)
                    req.prompt = text
                except Exception as e:  # validated on the loop side already; report, keep serving
                    self._emit(rid, e)
            elif kind == "abort":
                self._abort(arg)

    def _abort(self, request_id: str) -> None:
        req = self.engine.abort(request_id)
        if req is not None:
            self._snapshot()  # before the caller hears of the abort, so stats already show it
            out = delta_output(req)
            self._emit(request_id, out if out is not None else final_output(req))

    def _run(self) -> None:
        while True:
            if not self._drain_commands():
                self._snapshot()
                return
            if not self.engine.has_unfinished():
                self._snapshot()
                self.last_step_time = time.monotonic()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                changed = self.engine.step()
            except Exception as e:  # fail what was in flight, keep the engine alive for new work
                log.exception("engine step failed")
                self.step_error = e
                for rid in list(self.engine.requests):
                    req = self.engine.abort(rid, error=f"engine step failed: {e}")
                    if req is not None:
                        self._emit(rid, final_output(req))
                continue
            self.last_step_time = time.monotonic()
            self._snapshot()
            for req in changed:
                out = delta_output(req)
                if out is not None:
                    self._emit(req.request_id, out)
