"""Compile functions for the grammar compile child process (``GrammarCompilerService(...,
compile_target="tests.engine.compile_hooks:compile")``): a real child, a real kill, the real
xgrammar compile, except that the spec's text can ask for the behaviour of a pathological one.

- ``STUCK`` anywhere in the text: the compile never finishes (until the pool kills the child);
- ``GATE=<path>`` (up to a quote, a space or ``|``): the compile waits until ``<path>`` exists, then compiles;
- ``CRASH``: the child dies mid-compile.

Imported inside the child only: standard library, nothing from qworker."""

from __future__ import annotations

import os
import re
import time


def compile(compiler, request: dict):  # noqa: A001 - the name the target string uses
    text = request["text"]
    if "STUCK" in text:
        while True:
            time.sleep(60)
    if "CRASH" in text:
        os._exit(3)
    gate = re.search(r'GATE=([^"\s|]+)', text)
    if gate:
        path = gate.group(1)
        while not os.path.exists(path):
            time.sleep(0.01)
    kind = request["kind"]
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=request["any_whitespace"], strict_mode=request["strict_mode"])
    if kind == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)
