"""A pool of grammar compile processes: a compile past its budget is killed, not waited for.

xgrammar cannot cancel a compile, and a pathological schema can compile for minutes. In a thread
such a compile keeps its core (and its slot) long after its job was answered; in a process it is
one ``SIGKILL``. So each of the ``size`` slots is a thread that owns one compile process and runs
one compile at a time on it:

- the budget (``timeout_s``) counts from the moment the request is written to a ready process,
  never from submission: time spent queued behind other compiles, or starting a process, is not
  charged to the job;
- past the budget the process is killed and the job fails with a timeout; the slot forks a fresh
  one for its next job. Nothing else is held up: the other slots keep compiling;
- a process that dies mid-compile fails only the job it was on, and only after the compile has
  crashed a fresh process a second time: a process can also die of causes that are not the
  spec's (the zygote killed, whose death takes its forks with it; the OOM killer; an operator),
  and an innocent job must not get a non-retryable verdict for that;
- an idle process found dead before a compile is sent to it is replaced, not charged to the job;
- an answer that stops arriving (a process that hangs mid-answer) counts as a crash: each read of
  the answer must make progress within the budget, so no slot waits forever on a half answer;
- a compile interrupted by ``close()`` fails with ``CompilerUnavailable`` (the engine's, not the
  job's fault).

Processes are forks of one zygote (``compile_child.py``) that has imported xgrammar and loaded the
tokenizer once: a replacement costs milliseconds, not the seconds of a fresh interpreter
importing torch. The zygote starts on the first compile (a few seconds, once) and everything is
killed by ``close()``.

The price of a process is the trip back: the compiled grammar crosses a socket as xgrammar's
JSON (``serialize_json``, about 5x its in-memory size) and is rebuilt here (``deserialize_json``,
which releases the GIL; ~0.25 s for a 3.5 MB grammar). Small grammars cost well under a
millisecond.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from qworker.engine.structured.compile_child import HEADER, read_frame, write_frame

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0  # a child that is not ready by then is broken (it starts in ~2 s)
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_child.py")


class CompileTimeout(Exception):
    """The compile ran past its budget and its child was killed."""


class CompilerCrashed(Exception):
    """The child died while compiling (not a timeout)."""


class CompilerUnavailable(Exception):
    """No child could be started: the engine's fault, not the job's."""


@dataclass(eq=False)
class PoolJob:
    """One compile. ``on_start`` and ``on_done`` run on the slot's thread; ``wanted()`` False
    means nobody waits for the result any more and the job is dropped unstarted."""

    request: dict
    on_done: Callable[[str | None, BaseException | None, float], None]  # grammar JSON, error, seconds
    wanted: Callable[[], bool] = lambda: True
    on_start: Callable[[], None] = lambda: None
    started: float | None = field(default=None)


class _Child:
    """One compile process (a fork of the zygote), spoken to over its own socket."""

    def __init__(self, pid: int, sock: socket.socket):
        self.pid, self.sock = pid, sock
        self.wfd = self.rfd = sock.fileno()

    def signal_kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """Only on the slot thread that owns the child: a socket closed under a thread waiting on
        it does not wake that thread (epoll drops the closed descriptor and sleeps on)."""
        self.signal_kill()
        self.sock.close()


class _Zygote:
    """The process the compile processes are forked from (see ``compile_child.py``)."""

    def __init__(self, init: bytes):
        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen([sys.executable, _CHILD, str(theirs.fileno())], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        except OSError as e:
            ours.close()
            raise CompilerUnavailable(f"the grammar compile process did not start: {e}") from e
        finally:
            theirs.close()
        self.sock = ours
        try:
            write_frame(ours.fileno(), init)
            answer = read_frame(ours.fileno()) if _readable(ours.fileno(), _START_TIMEOUT_S) else None
        except OSError:  # it died before reading its init: still killed and reaped below
            answer = None
        if answer is None or answer[:1] != b"R":
            self.kill()
            why = str(memoryview(answer)[1:], "utf-8", "replace") if answer else f"it exited with {self.proc.poll()}"
            raise CompilerUnavailable(f"the grammar compile process did not start: {why}")

    def fork(self) -> _Child:
        ours, theirs = socket.socketpair()
        try:
            socket.send_fds(self.sock, [b"F"], [theirs.fileno()])
            answer = read_frame(self.sock.fileno()) if _readable(self.sock.fileno(), _START_TIMEOUT_S) else None
        except OSError:
            answer = None
        finally:
            theirs.close()
        if answer is None or len(answer) != 4:
            ours.close()
            raise CompilerUnavailable(f"the grammar compile zygote failed (exit status {self.proc.poll()})")
        return _Child(struct.unpack(">I", answer)[0], ours)

    def kill(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.wait()


class CompilePool:
    def __init__(self, tokenizer_info_json: Callable[[], str], *, size: int, timeout_s: float, xgr_threads: int = 1, target: str | None = None):
        """``tokenizer_info_json`` is called once, when the zygote first starts (an engine that
        never sees a structured request never pays for it)."""
        self.size = size
        self.timeout_s = timeout_s
        self._init_args = (tokenizer_info_json, xgr_threads, target)
        self._cond = threading.Condition()
        self._queue: deque[PoolJob] = deque()
        self._threads: list[threading.Thread] = []
        self._children: set[_Child] = set()
        self._zygote: _Zygote | None = None
        self._zygote_lock = threading.Lock()  # one fork at a time on the zygote's socket
        self._closed = False
        self.running = 0
        self.children_started = 0
        self.children_killed = 0

    def put(self, job: PoolJob) -> None:
        with self._cond:
            if self._closed:
                raise CompilerUnavailable("the grammar compiler is closed")
            self._queue.append(job)
            if len(self._threads) < self.size and len(self._threads) < self.running + len(self._queue):
                t = threading.Thread(target=self._slot, name=f"grammar-compile-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._cond.notify()

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self) -> None:
        """Kills every child; queued jobs, and those running, fail with ``CompilerUnavailable``."""
        with self._cond:
            self._closed = True
            dropped, self._queue = list(self._queue), deque()
            children = list(self._children)
            self._cond.notify_all()
        for c in children:  # their slots see the end of the answer and close the sockets
            c.signal_kill()
        with self._zygote_lock:
            if self._zygote is not None:
                self._zygote.kill()
                self._zygote = None
        for job in dropped:
            job.on_done(None, CompilerUnavailable("the grammar compiler is closed"), 0.0)

    # -- a slot ------------------------------------------------------------------------------------
    def _take(self) -> PoolJob | None:
        while True:
            dropped = []
            with self._cond:
                while not self._closed and not self._queue:
                    self._cond.wait()
                if self._closed:
                    return None
                while self._queue:
                    job = self._queue.popleft()
                    if job.wanted():
                        self.running += 1
                        break
                    dropped.append(job)
                else:
                    job = None
            for d in dropped:  # nobody waits for it: never started (told outside the lock)
                d.on_done(None, None, 0.0)
            if job is not None:
                return job

    def _slot(self) -> None:
        child: _Child | None = None
        try:
            while (job := self._take()) is not None:
                try:
                    if child is None:
                        child = self._start_child()
                    grammar, error, seconds, child = self._compile(child, job)
                except CompilerUnavailable as e:
                    grammar, error, seconds, child = None, e, 0.0, None
                except Exception as e:  # noqa: BLE001 - a bug here must not strand the job or the slot
                    log.exception("grammar compile slot failed")
                    if child is not None:
                        self._forget(child)
                    grammar, error, seconds, child = None, CompilerUnavailable(f"grammar compile failed: {e!r}"), 0.0, None
                with self._cond:
                    self.running -= 1
                try:
                    job.on_done(grammar, error, seconds)
                except Exception:  # noqa: BLE001 - the slot keeps serving the queue
                    log.exception("grammar compile completion failed")
                grammar = job = None  # the grammar's JSON (~5x the grammar) must not wait for the next job
        finally:
            if child is not None:
                self._forget(child)

    def _start_child(self) -> _Child:
        with self._zygote_lock:
            if self._closed:
                raise CompilerUnavailable("the grammar compiler is closed")
            if self._zygote is not None and self._zygote.proc.poll() is not None:
                self._zygote.kill()
                self._zygote = None
            if self._zygote is None:
                info, threads, target = self._init_args
                init = {"tokenizer_info": info(), "threads": threads, "target": target, "sys_path": [p or os.getcwd() for p in sys.path]}
                self._zygote = _Zygote(json.dumps(init).encode())
            child = self._zygote.fork()
        with self._cond:
            self.children_started += 1
            self._children.add(child)
            if self._closed:  # closed while it started: close() did not see it
                self._children.discard(child)
                child.kill()
                raise CompilerUnavailable("the grammar compiler is closed")
        return child

    def _forget(self, child: _Child) -> None:
        with self._cond:
            self._children.discard(child)
        child.kill()

    def _compile(self, child: _Child, job: PoolJob) -> tuple[str | None, BaseException | None, float, _Child | None]:
        """One request; returns the child to keep (None once it is killed). A crash is retried
        once on a fresh child: only a spec that crashes two processes is blamed for it."""
        job.on_start()
        job.started = time.monotonic()
        for attempt in (1, 2):
            if _readable(child.rfd, 0):  # an idle child has nothing to say: readable means dead
                self._forget(child)
                child = self._start_child()
            grammar, error, seconds, child = self._compile_once(child, job)
            if not isinstance(error, CompilerCrashed) or attempt == 2 or self._closed:
                break
            self._reap_zygote()
            log.warning("grammar compile process died mid-compile; retrying the compile once on a fresh process")
            child = self._start_child()
        if self._closed and isinstance(error, (CompilerCrashed, CompileTimeout)):
            error = CompilerUnavailable("the grammar compiler was closed during the compile")
        elif isinstance(error, CompilerCrashed):
            self._reap_zygote()
        return grammar, error, seconds, child

    def _compile_once(self, child: _Child, job: PoolJob) -> tuple[str | None, BaseException | None, float, _Child | None]:
        t0 = time.monotonic()
        body = None
        try:
            write_frame(child.wfd, json.dumps(job.request).encode())
            if not _readable(child.rfd, self.timeout_s):  # the budget: from the start of this compile
                self._forget(child)
                with self._cond:
                    self.children_killed += 1
                return None, CompileTimeout(f"grammar compilation did not finish within {self.timeout_s:g} s"), time.monotonic() - t0, None
            # the answer has begun; a large one arrives in pieces, each within the budget
            head = _read_exact_within(child.rfd, HEADER.size, self.timeout_s)
            body = None if head is None else _read_exact_within(child.rfd, HEADER.unpack(head)[0], self.timeout_s)
        except OSError:
            body = None
        seconds = time.monotonic() - t0
        if body is None:
            self._forget(child)
            return None, CompilerCrashed("the grammar compiler crashed on it (or stopped answering), on two fresh processes"), seconds, None
        if body[:1] == b"G":
            text = str(memoryview(body)[1:], "utf-8")  # no intermediate copy of a large answer
            del body
            return text, None, seconds, child
        return None, ValueError(str(memoryview(body)[1:], "utf-8", "replace")), seconds, child

    def _reap_zygote(self) -> None:
        """A dead zygote is reaped now (no defunct process left until the next compile) and
        replaced by the next ``_start_child``."""
        with self._zygote_lock:
            if self._zygote is not None and self._zygote.proc.poll() is not None:
                self._zygote.kill()
                self._zygote = None


def _read_exact_within(fd: int, n: int, idle_timeout: float) -> bytearray | None:
    """``n`` bytes from ``fd``; None at end of file or when no byte arrives for ``idle_timeout``
    seconds (a writer that hangs mid-answer)."""
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while pos < n:
            if not sel.select(idle_timeout):
                return None
            k = os.readv(fd, [view[pos:]])
            if k == 0:
                return None
            pos += k
    return buf


def _readable(fd: int, timeout: float) -> bool:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        return bool(sel.select(timeout))
