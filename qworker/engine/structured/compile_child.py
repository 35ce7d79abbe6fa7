"""The grammar compile processes: ``python compile_child.py FD`` (run by file name, so that it
imports neither ``qworker`` nor the engine, only xgrammar) starts a *zygote*; each compile
process is a fork of it.

Importing xgrammar (it imports torch) takes 2 s on an idle machine and 6-10 s on a loaded one;
a fork of a process that has already done it takes milliseconds. The pool kills a compile
process whenever a compile runs past its budget, so a cheap replacement matters.

Protocol (frames: a 4-byte big-endian length, then the bytes), on the Unix socket ``FD``:

1. the parent sends an init frame: JSON ``{"tokenizer_info": xgrammar's serialized tokenizer
   info, "threads": xgrammar threads, "target": "module:function" or null, "sys_path": [...]}``;
   the zygote answers ``R`` when it can compile (or ``E`` + a reason, then exits);
2. then, for each compile process the parent wants, it sends ``F`` with one end of a fresh socket
   pair attached (``SCM_RIGHTS``); the zygote forks, answers the child's pid (4 bytes), and the
   child serves that socket: one request at a time (JSON ``{"kind": "json" | "regex" | "grammar",
   "text": str, "any_whitespace": bool, "strict_mode": bool}``), answered ``G`` + the compiled
   grammar (``CompiledGrammar.serialize_json``) or ``E`` + the compiler's reason.

Every process here exits when its socket closes, and asks the kernel to kill it when its parent
dies (a compile can take minutes; nobody would read its answer). The zygote reaps its children
(``SIGCHLD`` ignored), so a killed compile process leaves no zombie.

``target`` replaces the compile function (``(compiler, request) -> CompiledGrammar``): tests use
it to make a compile block, as a pathological grammar would, inside a real compile process.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import struct
import sys

HEADER = struct.Struct(">I")


def write_frame(fd: int, data: bytes) -> None:
    view = memoryview(HEADER.pack(len(data)) + data) if len(data) < 1 << 16 else None
    if view is None:  # large: no copy of the payload just to prepend four bytes
        _write_all(fd, memoryview(HEADER.pack(len(data))))
        view = memoryview(data)
    _write_all(fd, view)


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def read_exact(fd: int, n: int) -> bytearray | None:
    """``n`` bytes from ``fd``, or None at end of file."""
    buf = bytearray(n)
    view, pos = memoryview(buf), 0
    while pos < n:
        k = os.readv(fd, [view[pos:]])
        if k == 0:
            return None
        pos += k
    return buf


def read_frame(fd: int) -> bytearray | None:
    head = read_exact(fd, HEADER.size)
    if head is None:
        return None
    return read_exact(fd, HEADER.unpack(head)[0])


def compile_request(compiler, request: dict):
    """The default compile: one xgrammar call per kind (choices arrive as a grammar)."""
    kind, text = request["kind"], request["text"]
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=request["any_whitespace"], strict_mode=request["strict_mode"])
    if kind == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the process still exits when its socket closes
        pass


def source_grammar(request: dict):
    """The request's grammar before compilation (milliseconds, no token masks): what the
    empty-language check reads. The compiled grammar's own serialization carries its automata
    (10 MB and 2.5 s of checking for a 3 MB grammar), this one does not."""
    import xgrammar as xgr

    kind, text = request["kind"], request["text"]
    if kind == "json":
        return xgr.Grammar.from_json_schema(text, any_whitespace=request["any_whitespace"], strict_mode=request["strict_mode"])
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    return xgr.Grammar.from_ebnf(text)


def _serve(fd: int, compiler, compile_fn) -> None:
    """A compile process: one request at a time until the socket closes."""
    from grammar_check import EMPTY_LANGUAGE, accepts_some_string  # this file's directory

    while (frame := read_frame(fd)) is not None:
        try:
            request = json.loads(frame)
            if not accepts_some_string(source_grammar(request).serialize_json()):
                raise ValueError(EMPTY_LANGUAGE)  # before the compile: nothing to spend on it
            compiled = compile_fn(compiler, request)
            answer = b"G" + compiled.serialize_json().encode()
        except Exception as e:  # noqa: BLE001 - xgrammar's RuntimeError for bad input; keep its words
            answer = b"E" + (str(e) or type(e).__name__).encode()
        compiled = None
        write_frame(fd, answer)
        answer = None


def main(ctrl_fd: int) -> int:
    _die_with_parent()
    ctrl = socket.socket(fileno=ctrl_fd)
    init_frame = read_frame(ctrl_fd)
    if init_frame is None:
        return 0
    try:
        init = json.loads(init_frame)
        sys.path.extend(p for p in init["sys_path"] if p not in sys.path)
        import xgrammar as xgr

        import grammar_check  # noqa: F401 - loaded once here, not in every fork

        info = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
        compiler = xgr.GrammarCompiler(info, max_threads=init["threads"], cache_enabled=False)
        compile_fn = compile_request
        if init.get("target"):
            module, _, name = init["target"].partition(":")
            compile_fn = getattr(importlib.import_module(module), name)
    except Exception as e:  # noqa: BLE001 - the parent reports it; not any job's fault
        write_frame(ctrl_fd, b"E" + f"compile process failed to start: {type(e).__name__}: {e}".encode())
        return 1
    del init, init_frame
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the forks: no zombies
    write_frame(ctrl_fd, b"R")
    while True:
        msg, fds, _, _ = socket.recv_fds(ctrl, 1, 1)
        if not msg or not fds:
            return 0
        pid = os.fork()
        if pid == 0:
            ctrl.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _die_with_parent()
            try:
                _serve(fds[0], compiler, compile_fn)
            finally:
                os._exit(0)
        os.close(fds[0])
        write_frame(ctrl_fd, struct.pack(">I", pid))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
