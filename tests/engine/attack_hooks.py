"""Compile functions for ``tests/engine/test_structured_attack.py`` (run inside the real compile
process, like ``compile_hooks.py``): behaviours of a broken compile process the pool must survive.

- ``STUCK``: the compile never finishes (until the pool kills the process);
- ``HALF``: the process writes the first half of an answer frame, then hangs (never finishes it);
- ``PID=<path>``: the process writes its pid to ``<path>`` and waits for ``<path>.go`` to exist, then
  compiles (the test kills it, or its zygote, in between);
- anything else: xgrammar's own compile.

Standard library only: it is imported in the compile process, not in the engine."""

from __future__ import annotations

import os
import re
import struct
import time


def _socket_fd() -> int:
    """The compile process's one socket: the channel its answers go back on."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                return int(name)
        except OSError:
            continue
    raise RuntimeError("no socket")


def compile(compiler, request: dict):  # noqa: A001 - the name the target string uses
    text = request["text"]
    if "STUCK" in text:
        while True:
            time.sleep(60)
    if "HALF" in text:
        fd = _socket_fd()
        os.write(fd, struct.pack(">I", 1000) + b"G" + b"{" * 100)  # 101 of the 1000 bytes announced
        while True:
            time.sleep(60)
    pid = re.search(r'PID=([^"\s|]+)', text)
    if pid:
        path = pid.group(1)
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(path + ".tmp", path)
        while not os.path.exists(path + ".go"):
            time.sleep(0.01)
    kind = request["kind"]
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=request["any_whitespace"], strict_mode=request["strict_mode"])
    if kind == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)
