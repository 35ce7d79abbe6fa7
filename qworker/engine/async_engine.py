"""``AsyncEngine``: the engine for asyncio callers (the Kafka worker).

The engine steps in its own thread; the event loop only enqueues commands and receives outputs,
so it never waits longer than it takes to hand over a step's outputs. Each ``generate()`` call is
an async generator of deltas; closing or cancelling it aborts the request.

Outputs go to the stream that added the request, not to whichever stream holds its id now: the
engine thread keeps its own map from request id to the adding stream (``_listeners``), and an
abort sent by a closing stream only touches the request that stream added. So an id can be reused
at once after an abort.
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
from qworker.engine.lora_request import LoRARequest
from qworker.engine.output_processor import delta_output, final_output
from qworker.engine.outputs import ERR_ENGINE, ERR_SHUTDOWN, RequestOutput
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.transient_thread import in_transient_thread
from qworker.model.parallel.errors import ExecutorFailed

log = logging.getLogger(__name__)
_IDLE_WAIT_S = 0.5  # the longest sleep with nothing to run (deadlines are checked at least this often)

class _Stream:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> bool:
        """From the engine thread; False when the stream's event loop has closed (nobody reads it)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        engine.thread_safe_tokenizer()  # the loop encodes while the engine thread decodes
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # the event loop's: ids in flight
        self._listeners: dict[str, _Stream] = {}  # the engine thread's: who added each request
        self._closed = False  # shut down: generate() refuses at once instead of waiting forever
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self.last_step_time = time.monotonic()
        self.ready = False
        self.step_error: BaseException | None = None
        # a fatal engine failure (a dead tensor-parallel rank, a defect that ended the engine
        # thread): the engine thread has ended and ``on_fatal`` (set by the worker) was called
        # with it from that thread
        self.fatal: BaseException | None = None
        self.on_fatal = None
        # snapshots written by the engine thread, read by the loop: the loop never walks the
        # scheduler's queues while the engine thread changes them
        self._capacity = engine.capacity()
        self._stats = engine.stats()
        self._lora_stats = engine.lora_stats()
        # a finished compile wakes the engine thread when it sleeps waiting for grammars
        engine.grammars.add_listener(self._wake.set)

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

    def lora_stats(self) -> dict:
        """Requests per LoRA adapter as of the last step: ``{"running": {name: n}, "waiting":
        {name: n}, "max_lora": max_loras}`` (vLLM's ``vllm:lora_requests_info``)."""
        return self._lora_stats

    def _snapshot(self) -> None:
        self._capacity = self.engine.capacity()
        self._stats = self.engine.stats()
        if self.engine.loras.enabled:
            self._lora_stats = self.engine.lora_stats()

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="qworker-engine", daemon=True)
        self._thread.start()
        self.ready = True

    async def shutdown(self) -> None:
        close = getattr(self.engine.runner, "close", None)  # tensor parallel: stops the follower ranks
        if self._thread is None:
            if close is not None:
                close()
            return
        self._commands.put(("stop", None))
        self._notify()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.ready = False
        self._closed = True
        if close is not None:
            await asyncio.to_thread(close)
        # requests added after the engine thread took "stop" were never seen by it: end them
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                arg[0].put(RuntimeError("the engine has shut down"))
            elif kind == "call":
                _settle_threadsafe(arg[1], arg[2], None, RuntimeError("the engine has shut down"))

    # -- requests ----------------------------------------------------------------------------------
    async def validate_structured(self, params: SamplingParams) -> None:
        """Compiles (or finds cached) ``params``'s structured-output spec on the compiler's own
        threads, off the event loop and the engine thread; raises ``StructuredOutputError`` (code
        ``invalid_structured_output``) for a spec the compiler refuses or a compile past the
        timeout. Then call ``generate(..., structured_validated=True)``."""
        if params.structured_outputs is None:
            return
        # await the compile's own completion: no thread of the loop's shared executor is held
        # (many cold schemas at once would starve every to_thread) and nothing polls
        handle = self.engine.grammars.submit(params.structured_outputs)
        if not handle.done:
            loop = asyncio.get_running_loop()
            done = loop.create_future()
            handle.add_done_callback(lambda _h: _resolve_threadsafe(loop, done))
            await done
        handle.result()  # raises StructuredOutputError for a refused spec or a timeout

    async def generate(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0, *,
                       deadline: float | None = None, structured_validated: bool = False,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yields deltas until the request finishes. Raises ``InvalidRequestError`` at once for a
        request that can never run, ``ValueError`` for a request id already in flight.
        ``deadline`` (``time.time()``): see ``LLMEngine.add_request``; an expired request's one
        output has finish_reason "abort" and ``error_code`` "deadline_exceeded". ``lora_request``:
        the LoRA adapter it runs under; an adapter that fails to load ends this request alone,
        finish_reason "abort", ``error_code`` "invalid_lora"."""
        if self._closed:
            raise RuntimeError("the engine has shut down")
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already in flight")
        ids = self.engine.encode(prompt)
        self.engine.check(ids, params)
        self.engine.check_lora(lora_request)
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._commands.put(("add", (stream, request_id, ids, params, priority, deadline, prompt if isinstance(prompt, str) else None, structured_validated,
                                    lora_request)))
        self._notify()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:
                self._commands.put(("abort", (request_id, stream)))
                self._notify()

    # -- LoRA adapters (vLLM's names) ---------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads and validates an adapter (on a worker thread) into the engine's CPU cache; raises
        ``InvalidRequestError`` ("invalid_lora") with the loader's reason."""
        # a thread that ends: the executor's would keep the load's OpenMP pool and throttle the
        # engine thread's parallel regions from then on (transient_thread.py)
        adapter = await asyncio.to_thread(in_transient_thread, self.engine.loras.load, lora_request)
        return await self._on_engine_thread(lambda: self.engine.add_lora_loaded(lora_request, adapter))

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._on_engine_thread(lambda: self.engine.remove_lora(lora_id))

    async def list_loras(self) -> set[int]:
        return await self._on_engine_thread(self.engine.list_loras)

    async def _on_engine_thread(self, fn):
        """``fn()`` where the engine's state may be touched: on the engine thread between steps
        (or here when that thread is not running)."""
        if self._thread is None:
            return fn()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._commands.put(("call", (fn, loop, fut)))
        self._notify()
        return await fut

    async def abort(self, request_id: str) -> None:
        """Aborts the request now holding ``request_id``; its stream gets a last "abort" delta."""
        self._commands.put(("abort", (request_id, None)))
        self._notify()

    def _notify(self) -> None:
        """After a command is queued: wakes the engine thread, whether it sleeps here (nothing to
        run) or inside ``step()`` (waiting for grammars)."""
        self._wake.set()
        self.engine.wake()

    # -- the engine thread -------------------------------------------------------------------------
    def _emit(self, request_id: str, item: RequestOutput) -> None:
        """Hands ``item`` to the stream that added the request; forgets the stream at the end. A
        stream whose event loop has closed aborts its request (nobody will read it)."""
        stream = self._listeners.pop(request_id, None) if item.finished else self._listeners.get(request_id)
        if stream is not None and not stream.put(item) and not item.finished:
            del self._listeners[request_id]
            self.engine.abort(request_id)

    def _end_with(self, request_id: str, error: BaseException) -> None:
        """Ends the request's stream with ``error`` (its outputs could not be made) and the
        request itself, if it is still in the engine."""
        stream = self._listeners.pop(request_id, None)
        if stream is not None:
            stream.put(error)
        try:
            self.engine.abort(request_id, f"{error!r}", ERR_ENGINE)
        except Exception:  # noqa: BLE001 - already logged with the error that brought us here
            log.exception("aborting %s failed", request_id)

    def _report(self, req) -> None:
        """Emits what ``req`` changed this step; a failure to build that ends the request alone."""
        try:
            out = delta_output(req)
        except Exception as e:  # noqa: BLE001 - one request's outputs must not stop the others'
            log.exception("request %s: building its output failed", req.request_id)
            self._end_with(req.request_id, e)
            return
        if out is not None:
            self._emit(req.request_id, out)

    def _drain_commands(self) -> bool:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                # a shutdown is not a cancel: the code tells a caller the request is worth redoing
                for rid in list(self.engine.requests):
                    self._abort(rid, "the engine shut down before the request finished", ERR_SHUTDOWN)
                return False
            if kind == "add":
                stream, rid, ids, params, priority, deadline, text, validated, lora = arg
                try:
                    req = self.engine.add_request(rid, ids, params, priority, deadline, structured_validated=validated, lora_request=lora)
                    req.prompt = text
                    self._listeners[rid] = stream
                except Exception as e:  # validated on the loop side already; report, keep serving
                    stream.put(e)
            elif kind == "call":
                fn, loop, fut = arg
                try:
                    result, error = fn(), None
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    result, error = None, e
                _settle_threadsafe(loop, fut, result, error)
            elif kind == "abort":
                rid, stream = arg
                if stream is None or self._listeners.get(rid) is stream:  # not a newer request's
                    self._abort(rid)

    def _abort(self, request_id: str, error: str | None = None, error_code: str | None = None) -> None:
        req = self.engine.abort(request_id, error, error_code)
        if req is not None:
            self._snapshot()  # before the caller hears of the abort, so stats already show it
            self._finish(req)

    def _finish(self, req) -> None:
        """Emits the last delta of an ended request (or its stream's error, if it cannot be made)."""
        try:
            out = _last_delta(req)
        except Exception as e:  # noqa: BLE001 - the stream must end whatever its outputs hit
            log.exception("request %s: building its last output failed", req.request_id)
            self._end_with(req.request_id, e)
            return
        self._emit(req.request_id, out)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a defect of the engine thread itself: nothing can run any more
            log.exception("the engine thread failed")
            self._fail(e)

    def _serve(self) -> None:
        while True:
            if not self._drain_commands():
                self._snapshot()
                return
            if not self.engine.has_unfinished():
                self._snapshot()
                self.last_step_time = time.monotonic()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                failure = getattr(self.engine.runner, "failure", None)  # a rank that died while idle
                if failure is not None:
                    self._fail(failure)
                    return
                continue
            steps = self.engine.counters["steps"]
            try:
                changed = self.engine.step()
            except ExecutorFailed as e:
                self._fail(e)
                return
            except Exception as e:
                # step() recovers from failures of the model and sampler itself; this is a bug in
                # the engine's own bookkeeping: fail what was in flight, keep serving new work
                log.exception("engine step failed")
                self.step_error = e
                for req in self.engine.take_unreported():  # ended by the step before it failed
                    self._finish(req)
                for rid in list(self.engine.requests):
                    self._abort(rid, f"engine step failed: {e!r}", ERR_ENGINE)
                continue
            self.last_step_time = time.monotonic()
            self._snapshot()
            for req in changed:
                self._report(req)
            if not changed and self.engine.counters["steps"] == steps and self.engine._compiling:
                # nothing can run until a grammar compiles: sleep until one does (the compile
                # service sets _wake), a command arrives, or the next request deadline is due
                self._wake.wait(timeout=self._idle_wait())
                self._wake.clear()

    def _fail(self, e: BaseException) -> None:
        """The engine cannot run any more (a dead tensor-parallel rank, or a defect that ended the
        engine thread): ``on_fatal`` first (the worker gives up on its jobs, uncommitted, and exits
        non-zero), then every stream raises ``e`` rather than wait forever. No request is answered
        with an error: each is left for a healthy engine to redo."""
        log.error("engine stopped: %s", e)
        self.fatal = self.step_error = e
        self.ready = False
        self._closed = True
        if self.on_fatal is not None:
            try:
                self.on_fatal(e)
            except Exception:  # noqa: BLE001 - the streams below must end whatever the callback hit
                log.exception("on_fatal failed")
        for stream in self._listeners.values():
            stream.put(e)
        self._listeners.clear()
        while True:  # requests queued but not yet added: the same
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                arg[0].put(e)
            elif kind == "call":
                _settle_threadsafe(arg[1], arg[2], None, e)

    def _idle_wait(self) -> float:
        deadlines = self.engine._deadlines
        if not deadlines:
            return _IDLE_WAIT_S
        return min(_IDLE_WAIT_S, max(0.0, deadlines[0][0] - time.time()))


def _settle_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, result, error: BaseException | None) -> None:
    """From the engine thread: completes ``fut`` with ``result`` or ``error`` on its loop."""

    def settle() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop closed: nobody awaits it any more
        pass


def _resolve_threadsafe(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
    """From a compile thread: completes ``fut`` on its loop (unless the loop is gone)."""
    try:
        loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
    except RuntimeError:  # the loop closed while the compile ran: nobody awaits it any more
        pass


def _last_delta(req) -> RequestOutput:
    """The finishing delta of an ended request: only what its stream has not had yet."""
    out = delta_output(req)
    if out is None:  # every choice was reported finished already; still close the stream
        out = final_output(req)
        out.outputs = []
    return out
