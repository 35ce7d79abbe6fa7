"""Attacks on the grammar compile pool (compile processes forked from a zygote): processes killed
by pid while idle or mid-compile, a process that hangs half way through its answer, a compile
killed by its budget under twenty waiters, the pool closed mid-compile, descriptors and zombies
after hundreds of compiles; and the offline engine over it: an unavailable compiler is the
engine's fault, a step waits on the compile instead of polling, bounded recursive and ``$defs``
schemas, regex, grammar and choice still constrain.

No assertion depends on the machine's speed: compiles are held by files the test creates
(``attack_hooks.py``), and budgets only bound hooks that never finish."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import threading
import time

import jsonschema
import pytest
import torch
import xgrammar as xgr

from qworker.engine import SamplingParams
from qworker.engine.llm import LLM
from qworker.engine.structured import CompilerUnavailable, GrammarCompilerService, StructuredOutputError, StructuredOutputsParams

from .structured_support import chat, tokenizer_info

HOOKS = "tests.engine.attack_hooks:compile"
TREE = {  # recursive, but bounded: children are optional, so a leaf ends it
    "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
                       "required": ["v"], "additionalProperties": False}},
    "$ref": "#/$defs/node",
}
PERSON = {
    "$defs": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"$ref": "#/$defs/age"}},
    "required": ["name", "age"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def ti():
    return tokenizer_info()


@pytest.fixture(scope="module")
def svc(ti):
    """Budgets long enough never to end a real compile: only the hooks decide outcomes."""
    s = GrammarCompilerService(ti, timeout_s=300, max_workers=2, compile_target=HOOKS)
    yield s
    s.close()


def _small(tag: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"type": "object", "properties": {tag: {"type": "integer"}}, "required": [tag]})


def _done(handle, limit: float = 300.0):
    """A guard against a hang (the defects here were hangs), not a timing."""
    assert handle.wait(limit), "the compile never finished"
    return handle


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _dead(pid: int) -> bool:
    end = time.monotonic() + 60
    while _state(pid) not in ("gone", "Z", "X"):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def _defunct_children() -> list[int]:
    kids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            continue
    return [k for k in kids if _state(k) == "Z"]


def _held(tmp_path, name: str) -> tuple[str, str]:
    """(a spec text that makes the compile process write its pid to a file and wait, the file)."""
    path = str(tmp_path / name)
    return f"a|PID={path}", path


def _pid_when_started(path: str) -> int:
    end = time.monotonic() + 300
    while not os.path.exists(path):
        assert time.monotonic() < end, "the compile never started"
        time.sleep(0.01)
    with open(path) as f:
        pid = int(f.read())
    os.unlink(path)
    return pid


def test_an_idle_compile_process_killed_by_pid_is_replaced_not_blamed_on_the_next_job(svc):
    """Before: the next job sent to the dead process failed with a non-retryable 'crashed'."""
    assert _done(svc.submit(_small("idle_a"))).ready
    for child in list(svc._pool._children):
        os.kill(child.pid, signal.SIGKILL)
        assert _dead(child.pid)
    handles = [svc.submit(_small(f"idle_b{i}")) for i in range(2)]
    for h in handles:
        assert _done(h).ready, h.error


def test_zygote_killed_mid_compile_the_compile_is_retried_on_a_respawned_zygote(svc, tmp_path):
    """Killing the zygote kills its forks (they die with their parent) and so the compile in
    flight: not the spec's fault. Before: the job failed with a non-retryable 'crashed'. After:
    the compile runs again on a fresh zygote, and no defunct process is left behind."""
    text, path = _held(tmp_path, "pid")
    h = svc.submit(StructuredOutputsParams(regex=text))
    first = _pid_when_started(path)
    zygote = svc._pool._zygote.proc.pid
    os.kill(zygote, signal.SIGKILL)
    assert _dead(first)  # the compile process went with its zygote
    second = _pid_when_started(path)  # the retry, on a fork of a new zygote
    assert second != first and svc._pool._zygote.proc.pid != zygote
    open(path + ".go", "w").close()
    assert _done(h).ready, h.error
    assert xgr.GrammarMatcher(h.result()).accept_string("a")
    assert _done(svc.submit(_small("after_zygote"))).ready
    assert _defunct_children() == []


def test_a_process_that_hangs_half_way_through_its_answer_fails_its_job_and_frees_its_slot(ti):
    """Before: the slot read the rest of the answer with no bound and hung forever, and every
    compile queued behind it with it."""
    s = GrammarCompilerService(ti, timeout_s=1.0, max_workers=1, compile_target=HOOKS)
    try:
        half = s.submit(StructuredOutputsParams(regex="HALF"))
        behind = s.submit(StructuredOutputsParams(regex="[0-9]+"))
        assert isinstance(_done(half).error, StructuredOutputError) and "stopped answering" in str(half.error)
        assert _done(behind).ready, behind.error
    finally:
        s.close()


def test_twenty_waiters_on_one_compile_killed_by_its_budget_all_fail_as_the_jobs_fault(ti):
    s = GrammarCompilerService(ti, timeout_s=1.0, max_workers=2, compile_target=HOOKS)
    try:
        spec = {"type": "object", "description": "STUCK twenty"}
        handles = [s.submit(StructuredOutputsParams(json=spec)) for _ in range(20)]
        for h in handles:
            assert isinstance(_done(h).error, StructuredOutputError) and "did not finish within 1 s" in str(h.error)
        st = s.stats()
        assert st["grammar_compilations"] == 1 and st["grammar_compile_timeouts"] == 1 and st["grammar_compiles_in_flight"] == 0
    finally:
        s.close()


def test_closing_the_compiler_mid_compile_is_the_engines_fault_not_the_jobs(ti):
    """A shutdown kills the compile processes; before, the compile they were running came back
    'crashed', a non-retryable invalid_structured_output for a job that did nothing wrong."""
    s = GrammarCompilerService(ti, timeout_s=300, max_workers=1, compile_target=HOOKS)
    running = s.submit(StructuredOutputsParams(regex="STUCK"))
    queued = s.submit(StructuredOutputsParams(regex="queued"))
    while not s._pool._children:
        time.sleep(0.01)
    pids = [c.pid for c in s._pool._children] + [s._pool._zygote.proc.pid]
    s.close()
    for h in (running, queued):
        assert isinstance(_done(h).error, CompilerUnavailable), repr(h.error)
        assert not isinstance(h.error, StructuredOutputError)
    assert all(_dead(p) for p in pids)
    assert _defunct_children() == []


def test_no_descriptor_or_zombie_left_after_200_compiles_and_some_aborted_while_queued(svc, tmp_path):
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    # both processes held, a queue of distinct schemas behind them, half of it aborted
    held = [_held(tmp_path, f"hold{i}") for i in range(2)]
    holders = [svc.submit(StructuredOutputsParams(regex=t)) for t, _ in held]
    for _, path in held:
        _pid_when_started(path)
    before = fds()  # both compile processes started: their sockets are counted
    compiles = svc.stats()["grammar_compilations"]
    queued = [svc.submit(_small(f"q{i}")) for i in range(8)]
    kept = queued[::2]
    del queued
    gc.collect()
    for _, path in held:
        open(path + ".go", "w").close()
    for h in holders + kept:
        assert _done(h).ready, h.error
    assert svc.stats()["grammar_compilations"] == compiles + len(kept)
    burst = [svc.submit(_small(f"burst{i}")) for i in range(200)]
    for h in burst:
        assert _done(h).ready, h.error
    assert fds() <= before  # waiting slots hold an epoll descriptor each at "before"; a leak would be +200
    assert _defunct_children() == []


# -- the offline engine ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(str(model_dir), device="cpu", kv_cache_memory=32 << 20, max_num_seqs=8)
    torch.set_num_threads(threads)


@pytest.fixture
def grammars(llm):
    """Installs a compiler service on the engine for one test; the engine's own is put back."""
    own = llm.engine.grammars
    made = []

    def install(**kw) -> GrammarCompilerService:
        s = GrammarCompilerService(llm.engine.tokenizer_info, **kw)
        made.append(s)
        llm.engine.grammars = s
        return s

    yield install
    llm.engine.grammars = own
    for s in made:
        s.close()


def test_offline_compiler_that_cannot_start_is_an_engine_error_not_the_jobs(llm, grammars):
    """Before: ``invalid_structured_output`` (the job's fault, never retried) for our failure."""
    grammars(compile_target="tests.engine.no_such_module:compile")
    refused = llm.engine.counters["requests_invalid_structured"]
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    out = llm.generate([chat("A number?")], params, use_tqdm=False)[0]
    assert out.error_code == "engine_error", (out.error_code, out.error)
    assert "compile" in (out.error or "")
    assert llm.engine.counters["requests_invalid_structured"] == refused  # counted only for the spec's fault


def test_offline_generate_sleeps_on_the_compile_instead_of_polling(llm, grammars, tmp_path):
    """While the only request waits for its grammar, ``step()`` sleeps until the compile
    finishes. Before: it returned every 5 ms, ~200 steps a second. The window is 1.5 s; a step
    sleeps 0.5 s at most without a wake, so at most a handful of steps fit whatever the speed."""
    grammars(compile_target=HOOKS, timeout_s=300)
    path = str(tmp_path / "offline")
    schema = {"type": "string", "enum": ["a"], "description": f"PID={path}"}
    calls = []
    real = llm.engine.step

    def counting_step():
        calls.append(time.monotonic())
        return real()

    llm.engine.step = counting_step
    try:
        params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema))
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("out", llm.generate([chat("Say a")], params, use_tqdm=False)))
        t.start()
        _pid_when_started(path)
        n0 = len(calls)
        time.sleep(1.5)
        pending = len(calls) - n0
        open(path + ".go", "w").close()
        t.join(300)
        assert not t.is_alive()
    finally:
        del llm.engine.step
    assert pending <= 5, f"{pending} steps in 1.5 s while only a compile was pending"
    assert result["out"][0].outputs[0].text == '"a"'


@pytest.mark.parametrize("kind", ["tree", "defs", "regex", "grammar", "choice"])
def test_offline_bounded_recursion_defs_regex_grammar_and_choice_constrain(llm, kind):
    specs = {
        "tree": (StructuredOutputsParams(json=TREE, disable_any_whitespace=True), "A small tree of digits as JSON."),
        "defs": (StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), "A person as JSON with name and age."),
        "regex": (StructuredOutputsParams(regex=r"[A-Z][a-z]{1,6} [0-9]{2}"), "A name and a number."),
        "grammar": (StructuredOutputsParams(grammar='root ::= "(" [a-c]+ ")" | "none"'), "Letters."),
        "choice": (StructuredOutputsParams(choice=["red", "green", "blue"]), "A colour?"),
    }
    spec, prompt = specs[kind]
    out = llm.generate([chat(prompt)], SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=spec), use_tqdm=False)[0]
    assert out.error_code is None, out.error
    c = out.outputs[0]
    if kind == "tree":  # greedy SmolLM2 nests until max_tokens: the prefix must still fit the tree
        grammar = llm.engine.grammars.validate(spec)
        assert xgr.GrammarMatcher(grammar).accept_string(c.text), c.text
        done = xgr.GrammarMatcher(grammar)
        assert done.accept_string('{"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]}') and done.is_completed()
        assert not xgr.GrammarMatcher(grammar).accept_string('{"v": 1, "kids": [{"w": 2}]}')
        if c.finish_reason == "length":
            return
    assert c.finish_reason == "stop", (c.finish_reason, c.text)
    if kind in ("tree", "defs"):
        jsonschema.validate(json.loads(c.text), TREE if kind == "tree" else PERSON)
    elif kind == "regex":
        assert re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{2}", c.text), c.text
    elif kind == "grammar":
        assert re.fullmatch(r"\([a-c]+\)|none", c.text), c.text
    else:
        assert c.text in ("red", "green", "blue")
