"""Grammar compilation off the engine thread, with a bounded LRU cache keyed by the spec hash.

``submit(spec)`` never blocks: it returns a ``CompileHandle`` the scheduler polls each step
(``done`` / ``ready`` / ``error``) while the request waits without holding up the batch. Each
handle carries its own deadline (``timeout_s`` from submission); past it the handle reports an
``invalid_structured_output`` timeout error. xgrammar cannot cancel a compile, so a compile past
its deadline keeps running on its thread; it gives its worker slot back (up to
``max_background`` such compiles at once, then it keeps the slot) so one pathological grammar
does not starve the rest. A compile that finishes late is still cached: its work is not wasted.

Invalid specs (bad schema, regex or grammar) are cached too, as their error: they are as
deterministic as valid ones. Timeouts are not cached. Identical specs in flight share one
compile (a joiner counts as a cache hit: it does not compile again).

Threads: xgrammar's compile releases the GIL (measured), so a compile thread costs the engine
thread no Python time, only a core.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import xgrammar as xgr

from qworker.engine.structured.spec import StructuredOutputError, StructuredOutputsParams, choice_to_ebnf

CompileFn = Callable[[StructuredOutputsParams], xgr.CompiledGrammar]
_LOG_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s+)?\S+\.(cc|h|cpp):\d+:\s*")
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def compiler_message(e: BaseException) -> str:
    """xgrammar's error text without its C++ log prefix (timestamp, source file and line)."""
    msg = str(e).strip()
    msg = _LOG_PREFIX.sub("", msg)
    return _CHECK_FAILED.sub("", msg).strip() or type(e).__name__


def make_compile_fn(tokenizer_info: xgr.TokenizerInfo, max_threads: int = 1) -> CompileFn:
    """Spec -> CompiledGrammar on one xgrammar compiler (its own cache off: ours is the cache)."""
    compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)

    def compile_spec(spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind = spec.kind
        compact = spec.disable_any_whitespace
        if kind == "json":
            return compiler.compile_json_schema(spec.schema, any_whitespace=not compact, strict_mode=spec.strict)
        if kind == "json_object":  # OpenAI's json_object is an object, not any JSON value
            return compiler.compile_json_schema({"type": "object"}, any_whitespace=not compact, strict_mode=False)
        if kind == "regex":
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_to_ebnf(spec.choice))
        return compiler.compile_grammar(spec.grammar)

    return compile_spec


class _Job:
    __slots__ = ("spec", "deadline", "event", "result", "error", "holds_slot")

    def __init__(self, spec: StructuredOutputsParams, deadline: float):
        self.spec = spec
        self.deadline = deadline  # the latest deadline of any handle waiting on it
        self.event = threading.Event()
        self.result: xgr.CompiledGrammar | None = None
        self.error: StructuredOutputError | None = None
        self.holds_slot = False


class CompileHandle:
    """One request's view of a compile. Non-blocking properties, safe to poll every step."""

    __slots__ = ("spec", "timeout_s", "deadline", "_job", "_service", "_result", "_error")

    def __init__(self, service: GrammarCompilerService, spec: StructuredOutputsParams, timeout_s: float, job: _Job | None = None,
                 result: xgr.CompiledGrammar | None = None, error: StructuredOutputError | None = None):
        self.spec = spec
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._service = service
        self._job = job
        self._result = result
        self._error = error

    @property
    def key(self) -> str:
        return self.spec.key

    @property
    def done(self) -> bool:
        """Compiled, failed or timed out: the request can leave the waiting-for-grammar state."""
        if self._job is None:
            return True
        job = self._job
        if job.event.is_set():
            self._result, self._error, self._job = job.result, job.error, None
            return True
        if time.monotonic() >= self.deadline:
            self._error = StructuredOutputError(f"grammar compilation did not finish within {self.timeout_s:g} s")
            self._job = None
            self._service._on_timeout()
            return True
        return False

    @property
    def ready(self) -> bool:
        return self.done and self._error is None

    @property
    def error(self) -> StructuredOutputError | None:
        return self._error if self.done else None

    def result(self) -> xgr.CompiledGrammar:
        """The compiled grammar; raises its ``StructuredOutputError``, or RuntimeError if not done."""
        if not self.done:
            raise RuntimeError("the grammar is still compiling")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done or ``timeout`` seconds (for worker threads, never the engine loop)."""
        end = self.deadline if timeout is None else min(self.deadline, time.monotonic() + timeout)
        job = self._job
        if job is not None:
            job.event.wait(max(0.0, end - time.monotonic()))
        while not self.done and time.monotonic() < end:  # the deadline lands a hair after the wait
            time.sleep(0.001)
        return self.done


class GrammarCompilerService:
    """``max_workers`` compiles at once (threads, started per compile); ``cache_size`` compiled
    specs kept (LRU), and at most ``cache_max_bytes`` of compiled grammar (xgrammar's
    ``memory_size_bytes``; None: no byte bound); ``timeout_s`` per request; ``compile_fn``
    replaceable for tests."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo | None = None, *, cache_size: int = 128, timeout_s: float = 10.0,
                 max_workers: int = 2, max_background: int = 2, compile_fn: CompileFn | None = None, xgr_threads: int = 1,
                 cache_max_bytes: int | None = None):
        if compile_fn is None:
            if tokenizer_info is None:
                raise ValueError("need a tokenizer_info or a compile_fn")
            compile_fn = make_compile_fn(tokenizer_info, xgr_threads)
        if cache_size < 1 or max_workers < 1 or max_background < 0 or not timeout_s > 0:
            raise ValueError("cache_size and max_workers must be >= 1, max_background >= 0, timeout_s > 0")
        self.tokenizer_info = tokenizer_info
        self.cache_size = cache_size
        self.cache_max_bytes = cache_max_bytes
        self._cache_bytes = 0
        self.timeout_s = timeout_s
        self.max_workers = max_workers
        self.max_background = max_background
        self._compile_fn = compile_fn
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, xgr.CompiledGrammar | StructuredOutputError] = OrderedDict()
        self._inflight: dict[str, _Job] = {}
        self._queue: deque[_Job] = deque()
        self._slots_used = 0
        self._background = 0  # compiles past every deadline that gave their slot back
        self.compilations = 0
        self.compile_failures = 0
        self.cache_hits = 0
        self.timeouts = 0
        self.compile_seconds = 0.0

    # -- the API -------------------------------------------------------------------------------
    def submit(self, spec: StructuredOutputsParams, timeout_s: float | None = None, *, admitted: bool = False) -> CompileHandle:
        """``admitted``: this request's spec was already looked up by ``validate`` at admission;
        the engine's own look-up is then not counted as a second cache hit."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        with self._lock:
            hit = self._cache.get(spec.key)
            if hit is not None:
                self._cache.move_to_end(spec.key)
                self.cache_hits += not admitted
                if isinstance(hit, StructuredOutputError):
                    return CompileHandle(self, spec, timeout, error=StructuredOutputError(str(hit)))
                return CompileHandle(self, spec, timeout, result=hit)
            handle = CompileHandle(self, spec, timeout)
            job = self._inflight.get(spec.key)
            if job is not None:
                self.cache_hits += not admitted
                job.deadline = max(job.deadline, handle.deadline)
            else:
                job = _Job(spec, handle.deadline)
                self._inflight[spec.key] = job
                self._queue.append(job)
            handle._job = job
            self._reap_locked()
            self._dispatch_locked()
        return handle

    def validate(self, spec: StructuredOutputsParams, timeout_s: float | None = None) -> xgr.CompiledGrammar:
        """Blocking: compile (or hit the cache) and return the grammar, or raise
        ``StructuredOutputError``. For admission on a worker thread; later submits of the same
        spec are cache hits."""
        handle = self.submit(spec, timeout_s)
        handle.wait()
        return handle.result()

    def stats(self) -> dict:
        with self._lock:
            return {
                "grammar_compilations": self.compilations,
                "grammar_compile_failures": self.compile_failures,
                "grammar_cache_hits": self.cache_hits,
                "grammar_compile_timeouts": self.timeouts,
                "grammar_compile_seconds": self.compile_seconds,
                "grammar_cache_size": len(self._cache),
                "grammar_cache_bytes": self._cache_bytes,
                "grammar_compiles_queued": len(self._queue),
                "grammar_compiles_running": self._slots_used,
                "grammar_compiles_background": self._background,
            }

    def cached(self, key: str) -> bool:
        with self._lock:
            return key in self._cache

    # -- internals -----------------------------------------------------------------------------
    def _on_timeout(self) -> None:
        with self._lock:
            self.timeouts += 1
            self._reap_locked()
            self._dispatch_locked()

    def _reap_locked(self) -> None:
        """Running compiles past every waiter's deadline give their slot back (bounded)."""
        now = time.monotonic()
        for job in self._inflight.values():
            if job.holds_slot and now >= job.deadline and self._background < self.max_background:
                job.holds_slot = False
                self._slots_used -= 1
                self._background += 1

    def _dispatch_locked(self) -> None:
        now = time.monotonic()
        while self._queue and self._slots_used < self.max_workers:
            job = self._queue.popleft()
            if now >= job.deadline:  # nobody waits for it any more: never start it
                del self._inflight[job.spec.key]
                continue
            job.holds_slot = True
            self._slots_used += 1
            self.compilations += 1
            threading.Thread(target=self._run, args=(job,), name="grammar-compile", daemon=True).start()

    def _store_locked(self, key: str, value: xgr.CompiledGrammar | StructuredOutputError) -> None:
        old = self._cache.pop(key, None)
        if old is not None:
            self._cache_bytes -= _size(old)
        self._cache[key] = value
        self._cache_bytes += _size(value)
        limit = self.cache_max_bytes
        while len(self._cache) > self.cache_size or (limit is not None and self._cache_bytes > limit and len(self._cache) > 1):
            _, evicted = self._cache.popitem(last=False)
            self._cache_bytes -= _size(evicted)

    def _run(self, job: _Job) -> None:
        t0 = time.perf_counter()
        result = error = None
        try:
            result = self._compile_fn(job.spec)
        except Exception as e:  # xgrammar raises RuntimeError for bad input; keep its words
            error = StructuredOutputError(f"invalid {job.spec.kind}: {compiler_message(e)}")
        dt = time.perf_counter() - t0
        with self._lock:
            self.compile_seconds += dt
            self._inflight.pop(job.spec.key, None)
            if error is not None:
                self.compile_failures += 1
            self._store_locked(job.spec.key, result if error is None else error)
            if job.holds_slot:
                job.holds_slot = False
                self._slots_used -= 1
            else:
                self._background -= 1
            job.result, job.error = result, error
            job.event.set()
            self._reap_locked()
            self._dispatch_locked()


def _size(value: object) -> int:
    return value.memory_size_bytes if isinstance(value, xgr.CompiledGrammar) else 0
