"""Grammar compilation off the engine thread: one compile per distinct spec, a byte-bounded cache.

``submit(spec)`` never blocks: it returns a ``CompileHandle`` the scheduler polls each step
(``done`` / ``ready`` / ``error``) while the request waits without holding up the batch; a caller
that wants to sleep instead registers ``add_done_callback`` (the async engine wakes on it) or
calls ``wait``.

Where compiles run: in child processes (``compile_pool.py``), ``max_workers`` at once. xgrammar
cannot cancel a compile and a pathological schema can compile for minutes, so a compile gets a
budget of ``timeout_s`` counted from when it starts (never from submission: a job queued behind
slow compiles is not charged for them) and past it its process is killed; the job fails with
``invalid_structured_output``, and only that job. A thread pool could not do that: a timed-out
compile would keep its core and its slot. The cost is that a compiled grammar crosses a pipe as
xgrammar's JSON and is rebuilt here (see ``compile_pool.py``); grammars are small for ordinary
schemas.

Single flight: one compile per distinct spec (``spec.key``) in flight; every request with that
spec joins it (a joiner counts as a cache hit). When it finishes, the result goes into the cache
*and* onto each waiting request's spec object (``spec.compiled``), so the request keeps its
grammar until it is done with it: a burst of distinct schemas larger than the cache evicts
entries between admission (``validate``) and the engine's ``submit``, and without this every
schema would be compiled twice.

The cache is an LRU bounded by ``cache_size`` entries and by ``cache_max_bytes`` of compiled
grammar (xgrammar's ``memory_size_bytes``; 256 MiB by default). A grammar larger than the whole
byte bound is not cached at all: its requests hold it while they run. Specs the compiler refuses
are cached as their error (deterministic, and a few bytes). Timeouts and crashes are not cached.

Refused specs: anything xgrammar rejects, and a grammar that admits no finite output (``{"$ref":
"#"}``; see ``grammar_check.py``), fail with ``StructuredOutputError`` carrying the compiler's
reason (``invalid_structured_output``, not retryable). When no compile process can be started,
``CompilerUnavailable`` (not a ``StructuredOutputError``: the engine's fault, retryable).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable

import xgrammar as xgr

from qworker.engine.structured.compile_pool import CompilePool, CompilerCrashed, CompilerUnavailable, CompileTimeout, PoolJob
from qworker.engine.structured.spec import StructuredOutputError, StructuredOutputsParams, choice_to_ebnf

DEFAULT_CACHE_BYTES = 256 << 20
_LOG_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s+)?\S+\.(cc|h|cpp):\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")

__all__ = ["DEFAULT_CACHE_BYTES", "CompileHandle", "CompilerUnavailable", "GrammarCompilerService", "compile_request", "compiler_message"]


def compiler_message(e: BaseException) -> str:
    """xgrammar's error text without its C++ log prefix (timestamp, source file and line)."""
    msg = str(e).strip()
    msg = _LOG_PREFIX.sub("", msg)
    return _CHECK_FAILED.sub("", msg).strip() or type(e).__name__


def compile_request(spec: StructuredOutputsParams) -> dict:
    """What the compile process needs of a spec (see ``compile_child.py``)."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        compact = spec.disable_any_whitespace
        if kind == "json_object":  # OpenAI's json_object is an object, not any JSON value
            return {"kind": "json", "text": '{"type": "object"}', "any_whitespace": not compact, "strict_mode": False}
        return {"kind": "json", "text": json.dumps(spec.schema), "any_whitespace": not compact, "strict_mode": spec.strict}
    if kind == "regex":
        return {"kind": "regex", "text": spec.regex}
    return {"kind": "grammar", "text": choice_to_ebnf(spec.choice) if kind == "choice" else spec.grammar}


class _Job:
    """One compile in flight, shared by every handle with its spec."""

    __slots__ = ("spec", "event", "result", "error", "handles")

    def __init__(self, spec: StructuredOutputsParams):
        self.spec = spec
        self.event = threading.Event()
        self.result: xgr.CompiledGrammar | None = None
        self.error: BaseException | None = None
        self.handles: weakref.WeakSet[CompileHandle] = weakref.WeakSet()  # who still waits

    def wanted(self) -> bool:
        """Someone still holds a handle: a request that was aborted drops its handle with it."""
        return len(self.handles) > 0


class CompileHandle:
    """One request's view of a compile. Non-blocking properties, safe to poll every step."""

    __slots__ = ("spec", "_job", "_result", "_error", "_callbacks", "__weakref__")

    def __init__(self, spec: StructuredOutputsParams, job: _Job | None = None, result: xgr.CompiledGrammar | None = None,
                 error: BaseException | None = None):
        self.spec = spec
        self._job = job
        self._result = result
        self._error = error
        self._callbacks: list[Callable[[CompileHandle], None]] = []
        if job is not None:
            job.handles.add(self)

    @property
    def key(self) -> str:
        return self.spec.key

    @property
    def done(self) -> bool:
        """Compiled, refused or timed out: the request can leave the waiting-for-grammar state."""
        job = self._job
        if job is None:
            return True
        if job.event.is_set():
            self._result, self._error, self._job = job.result, job.error, None
            return True
        return False

    @property
    def ready(self) -> bool:
        return self.done and self._error is None

    @property
    def error(self) -> BaseException | None:
        """A ``StructuredOutputError`` for the spec's own fault; another exception for ours."""
        return self._error if self.done else None

    def result(self) -> xgr.CompiledGrammar:
        """The compiled grammar; raises its error, or RuntimeError if not done."""
        if not self.done:
            raise RuntimeError("the grammar is still compiling")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or ``timeout`` seconds (for worker threads, never the engine loop)."""
        job = self._job
        if job is not None:
            job.event.wait(timeout)
        return self.done

    def add_done_callback(self, fn: Callable[[CompileHandle], None]) -> None:
        """``fn(handle)`` once done: now if it is, else on a compile thread (keep it short)."""
        job = self._job
        if job is not None:
            with _CALLBACK_LOCK:
                if not job.event.is_set():
                    self._callbacks.append(fn)
                    return
        fn(self)


_CALLBACK_LOCK = threading.Lock()  # orders add_done_callback against the job's completion


class GrammarCompilerService:
    """``max_workers`` compile processes; ``cache_size`` entries and ``cache_max_bytes`` of compiled
    grammar cached (LRU; None: no byte bound); ``timeout_s`` per compile, from its start.
    ``compile_target`` (``"module:function"``, run in the compile process) replaces xgrammar's
    compile call: tests use it to make a compile block as a pathological grammar would."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, *, cache_size: int = 128, cache_max_bytes: int | None = DEFAULT_CACHE_BYTES,
                 timeout_s: float = 10.0, max_workers: int = 2, xgr_threads: int = 1, compile_target: str | None = None):
        if cache_size < 1 or max_workers < 1 or not timeout_s > 0 or (cache_max_bytes is not None and cache_max_bytes < 0):
            raise ValueError("cache_size and max_workers must be >= 1, timeout_s > 0, cache_max_bytes >= 0 or None")
        self.tokenizer_info = tokenizer_info
        self.cache_size = cache_size
        self.cache_max_bytes = cache_max_bytes
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self._pool = CompilePool(tokenizer_info.serialize_json, size=max_workers, timeout_s=timeout_s, xgr_threads=xgr_threads,
                                 target=compile_target)
        weakref.finalize(self, self._pool.close)  # the children go with the service
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, xgr.CompiledGrammar | StructuredOutputError] = OrderedDict()
        self._cache_bytes = 0
        self._released = 0  # bytes evicted since the allocator last gave memory back
        self._inflight: dict[str, _Job] = {}
        self._listeners: list[Callable[[], None]] = []
        self.compilations = 0
        self.compile_failures = 0
        self.cache_hits = 0
        self.timeouts = 0
        self.crashes = 0
        self.compile_seconds = 0.0

    # -- the API -------------------------------------------------------------------------------
    def submit(self, spec: StructuredOutputsParams, *, admitted: bool = False) -> CompileHandle:
        """``admitted``: this request's spec was already looked up by ``validate`` at admission;
        the engine's own look-up is then not counted as a second cache hit."""
        with self._lock:
            value = self._cache.get(spec.key)
            if value is not None:
                self._cache.move_to_end(spec.key)
            else:
                value = spec.compiled  # compiled for this very request, then evicted: no recompile
            if value is not None:
                self.cache_hits += not admitted
                if isinstance(value, StructuredOutputError):
                    return CompileHandle(spec, error=StructuredOutputError(str(value)))
                return CompileHandle(spec, result=value)
            job = self._inflight.get(spec.key)
            if job is not None:
                self.cache_hits += not admitted  # joins the compile in flight
                return CompileHandle(spec, job)
            job = self._inflight[spec.key] = _Job(spec)
            handle = CompileHandle(spec, job)
        self._put(job)
        return handle

    def validate(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Blocking compile (or cache hit); raises ``StructuredOutputError`` for a bad spec or a
        compile past the timeout. For admission, on a worker thread."""
        handle = self.submit(spec)
        handle.wait()
        return handle.result()

    def add_listener(self, fn: Callable[[], None]) -> None:
        """``fn()`` after every compile finishes, on a compile thread (e.g. to wake a loop)."""
        self._listeners.append(fn)

    def close(self) -> None:
        """Kills the compile processes; compiles still queued fail with ``CompilerUnavailable``."""
        self._pool.close()

    def stats(self) -> dict:
        with self._lock:
            return {
                "grammar_compilations": self.compilations,
                "grammar_compile_failures": self.compile_failures,
                "grammar_cache_hits": self.cache_hits,
                "grammar_compile_timeouts": self.timeouts,
                "grammar_compile_crashes": self.crashes,
                "grammar_compile_seconds": self.compile_seconds,
                "grammar_cache_size": len(self._cache),
                "grammar_cache_bytes": self._cache_bytes,
                "grammar_compiles_in_flight": len(self._inflight),
                "grammar_compiles_queued": self._pool.queued(),
                "grammar_compiles_running": self._pool.running,
                "grammar_compile_processes_started": self._pool.children_started,
                "grammar_compile_processes_killed": self._pool.children_killed,
            }

    def cached(self, key: str) -> bool:
        with self._lock:
            return key in self._cache

    # -- internals -----------------------------------------------------------------------------
    def _put(self, job: _Job) -> None:
        try:
            self._pool.put(PoolJob(compile_request(job.spec), on_done=lambda g, e, s: self._finish(job, g, e, s), wanted=job.wanted,
                                   on_start=self._count_start))
        except CompilerUnavailable as e:
            self._finish(job, None, e, 0.0)

    def _count_start(self) -> None:
        with self._lock:
            self.compilations += 1

    def _finish(self, job: _Job, grammar_json: str | None, error: BaseException | None, seconds: float) -> None:
        """On a compile thread: rebuild the grammar (GIL released), publish it, wake the waiters."""
        key, kind = job.spec.key, job.spec.kind
        if grammar_json is None and error is None:  # dropped unstarted: nobody waited for it
            with self._lock:
                if not job.wanted():
                    self._inflight.pop(key, None)
                    return
            self._put(job)  # someone joined while it was being dropped
            return
        result = None
        cache = True  # deterministic outcomes only: a grammar, or the compiler's refusal
        timed_out, crashed = isinstance(error, CompileTimeout), isinstance(error, CompilerCrashed)
        if grammar_json is not None:
            with self._lock:  # its parse leaves ~10x its size of freed heap behind: trimmed like an eviction
                self._released += len(grammar_json)
            try:
                result = xgr.CompiledGrammar.deserialize_json(grammar_json, self.tokenizer_info)
            except Exception as e:  # noqa: BLE001 - ours, not the spec's
                error, cache = CompilerUnavailable(f"could not load the compiled grammar: {e}"), False
            del grammar_json
        elif isinstance(error, ValueError):
            error = StructuredOutputError(f"invalid {kind}: {compiler_message(error)}")
        elif timed_out or crashed:
            error, cache = StructuredOutputError(str(error)), False
        else:
            cache = False
        with self._lock:
            self.compile_seconds += seconds
            self.timeouts += timed_out
            self.crashes += crashed
            self.compile_failures += error is not None and cache
            self._inflight.pop(key, None)
            if cache:
                value = result if error is None else error
                self._store_locked(key, value)
                for h in list(job.handles):
                    object.__setattr__(h.spec, "compiled", value)
            job.result, job.error = result, error
        self._trim_if_released()
        with _CALLBACK_LOCK:
            job.event.set()
            callbacks = [(h, fn) for h in list(job.handles) for fn in h._callbacks]
        for h, fn in callbacks:
            fn(h)
        for fn in self._listeners:
            fn()

    def _store_locked(self, key: str, value: xgr.CompiledGrammar | StructuredOutputError) -> None:
        size = _size(value)
        limit = self.cache_max_bytes
        old = self._cache.pop(key, None)
        if old is not None:
            self._cache_bytes -= _size(old)
        if limit is not None and size > limit:
            return  # larger than the whole bound: its requests hold it, the cache does not
        self._cache[key] = value
        self._cache_bytes += size
        while len(self._cache) > self.cache_size or (limit is not None and self._cache_bytes > limit):
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= _size(evicted)
            self._released += _size(evicted)

    def _trim_if_released(self) -> None:
        """Evicted grammars (and the parse of each grammar's JSON) are many small C++ allocations that glibc keeps in its arenas (the
        compile threads each have one): measured, a burst of 30 distinct 1.3 MB grammars against
        an 8 MiB bound left RSS 43 MiB up, all of it given back by ``malloc_trim``. So trim once
        enough has been evicted that it is worth a walk of the heap."""
        with self._lock:
            if self._released < _TRIM_AFTER_BYTES:
                return
            self._released = 0
        _malloc_trim()


def _malloc_trim() -> None:
    global _libc_trim
    if _libc_trim is None:
        try:
            import ctypes

            _libc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc: nothing to trim with
            _libc_trim = False
    if _libc_trim:
        _libc_trim(0)


_libc_trim = None
_TRIM_AFTER_BYTES = 8 << 20


def _size(value: object) -> int:
    return value.memory_size_bytes if isinstance(value, xgr.CompiledGrammar) else 0
