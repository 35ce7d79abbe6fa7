"""Hostile tests of tensor parallelism on CPU (gloo, two ranks, the 2-layer tiny Llama): ways a
group can break other than a follower dying, each of which must end in ExecutorFailed at once or
within the collective timeout, never a hang and never ranks silently out of step; and no spawned
rank may outlive its engine.

- a follower frozen (SIGSTOP) while the leader is idle: the leader's ping waits for the frozen
  receiver, so it must give up at the collective timeout (the control group's own timeout is the
  long start-up one) and mark the group failed;
- an interrupt (KeyboardInterrupt) raised inside the leader's forward, between two all-reduces:
  the follower waits in an all-reduce the leader never joins, so the group is failed at once
  instead of the next step pairing the wrong collectives or hanging;
- a RuntimeError (an OOM, a poison request) inside the leader's forward: a request's failure,
  not the group's: the leader joins the all-reduces it owes, the step recovery isolates the
  culprit, the others give one rank's tokens.

Cost: one tiny follower spawn per test (each test breaks or poisons its group).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from qworker.engine import EngineConfig, LLMEngine, SamplingParams
from qworker.model.parallel import leader as leader_mod
from qworker.model.parallel.errors import ExecutorFailed
from tests.engine.engine_support import outputs, run


@pytest.fixture
def two(tiny_model_dir, monkeypatch):
    """A TP=2 engine on the tiny model; closed, and its follower checked gone, at teardown."""
    import torch

    monkeypatch.setenv("QWORKER_TP_TIMEOUT_S", "3")  # a frozen rank is given up on quickly
    monkeypatch.setattr(leader_mod, "PING_INTERVAL_S", 0.5)
    threads = torch.get_num_threads()
    e = LLMEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, kv_cache_memory=4 << 20, max_num_seqs=4))
    pids = [p.pid for p in e.runner._procs]
    try:
        yield e
    finally:
        closer = threading.Thread(target=e.runner.close, daemon=True)
        closer.start()
        closer.join(60)
        if closer.is_alive():  # a close stuck behind a wedged collective: free it, then fail
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            closer.join(30)
        torch.set_num_threads(threads)
        assert not closer.is_alive(), "close() hung"
        assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], "a follower outlived its engine"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def wait_for(cond, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.05)
    return cond()


def test_frozen_idle_follower_fails_the_group(two):
    """Before the fix the watcher's ping sat in the control broadcast for the start-up timeout
    (900 s) holding the runner's lock, so the failure was never seen and the next step blocked."""
    follower = two.runner._procs[0]
    os.kill(follower.pid, signal.SIGSTOP)
    assert wait_for(lambda: two.runner.failure is not None, 30), "a frozen follower went unnoticed"
    assert isinstance(two.runner.failure, ExecutorFailed)
    two.add_request("after", "hello", greedy(2))
    raised: list[BaseException] = []

    def step():
        try:
            two.step()
        except BaseException as e:  # noqa: BLE001 - checked below
            raised.append(e)

    t = threading.Thread(target=step, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the step hung on a frozen follower"
    assert len(raised) == 1 and isinstance(raised[0], ExecutorFailed)
    assert two.counters["requests_failed"] == 0 and not two.scheduler.suspects


def test_interrupt_inside_the_leaders_forward_fails_the_group(two):
    """A KeyboardInterrupt after the first all-reduce of a step: the follower is left inside the
    second one. The group must be failed there and then (before the fix it was not: the next
    step waited out the collective timeout, or, with a batch of the same shape, summed the
    leader's new step with the follower's old one)."""
    layer = two.runner.local.model.layers[0]
    inner = layer.down.inner
    armed = [True]

    def interrupted(x):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return inner(x)

    layer.down.inner = interrupted
    two.add_request("x", "The capital of France is", greedy(4))
    with pytest.raises(KeyboardInterrupt):
        two.step()
    assert isinstance(two.runner.failure, ExecutorFailed)
    two.abort("x")
    two.add_request("y", "The capital of France is", greedy(4))
    with pytest.raises(ExecutorFailed):
        two.step()
    assert two.counters["requests_failed"] == 0


POISON = 777  # a prompt token whose prefill fails inside the leader's forward


def test_a_failure_inside_the_leaders_forward_fails_its_request_alone(two, tiny_model_dir):
    """A request whose forward raises on the leader after some of the step's all-reduces (as a
    CUDA OOM in one layer would). Before the fix any such failure was fatal for the group: the
    worker exited, and the job, redelivered, took down every pod in turn. Now the leader joins
    the all-reduces it owes with zeros, the follower ends the step, and the engine's step
    recovery runs as with one rank: the poison request fails alone (its prefill fails with
    everyone, on the engine's very first step, then alone), every other request gives one
    rank's greedy tokens."""
    one = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=4 << 20, max_num_seqs=4))
    prompts = {"a": [5, 6, 7, 8, 9, 10], "b": [11, 12, 13], "c": [20, 21, 22, 23, 24, 25, 26, 27, 28]}
    for rid, p in prompts.items():
        one.add_request(rid, p, greedy(6))
    want = {k: outputs(r) for k, r in run(one, max_s=60).items()}

    poisoned = [False]
    raised = [0]
    real_execute = two.runner.local.execute

    def execute(batch):
        poisoned[0] = any(POISON in c.token_ids for c in batch.chunks)
        return real_execute(batch)

    def failing(index: int, inner):
        """Layer ``index``'s o projection, raising before its all-reduce on a poisoned step: the
        first time in layer 0 (the engine's first step: no all-reduce seen yet, all owed), the
        second time in layer 1 (two done, two owed), the third (the poison alone again) in layer 0."""

        def o(x):
            if poisoned[0] and raised[0] % 2 == index:
                raised[0] += 1
                raise RuntimeError("out of memory (injected)")
            return inner(x)

        return o

    two.runner.local.execute = execute
    for i, layer in enumerate(two.runner.local.model.layers[:2]):
        layer.o.inner = failing(i, layer.o.inner)
    for rid, p in prompts.items():
        two.add_request(rid, p, greedy(6))
    two.add_request("poison", [30, 31, POISON, 32], greedy(6))
    done = run(two, max_s=60)
    assert raised[0] == 3, "once with everyone, twice alone"
    assert two.runner.failure is None
    assert done["poison"].error_code == "engine_error"
    assert {k: outputs(done[k]) for k in prompts} == want
    # the group is still in step: a new request gives one rank's tokens
    two.add_request("again", prompts["c"], greedy(6))
    assert outputs(run(two, max_s=60)["again"]) == want["c"]
    assert two.counters["requests_failed"] == 1 and two.counters["steps_failed"] == 3


def test_a_dropped_engine_gives_back_its_cores_and_followers(tiny_model_dir):
    """An engine dropped without close() (``del llm``): its finalizer killed the followers but
    left the process at rank 0's share of the cores (cpu_count / tp torch threads), so a later
    engine in the same process ran on half the machine."""
    import gc

    import torch

    before = torch.get_num_threads()
    e = LLMEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, kv_cache_memory=4 << 20, max_num_seqs=2))
    pids = [p.pid for p in e.runner._procs]
    e.add_request("a", [5, 6, 7], greedy(2))
    run(e, max_s=60)
    del e
    gc.collect()
    try:
        assert wait_for(lambda: not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], 20), "a follower outlived its engine"
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_a_start_up_failure_after_the_followers_started_stops_them(tiny_model_dir, monkeypatch):
    """The KV budget is found too small only after the tensor-parallel runner has spawned its
    follower: the failed start must stop it then, not whenever the garbage collector gets to the
    half-built engine (the runner is kept alive here, as a traceback or a caller's frame may)."""
    import torch

    threads = torch.get_num_threads()
    built = []
    real_init = leader_mod.ParallelRunner.__init__

    def recording_init(self, *a, **kw):
        built.append(self)
        real_init(self, *a, **kw)

    monkeypatch.setattr(leader_mod.ParallelRunner, "__init__", recording_init)
    try:
        with pytest.raises(ValueError, match="KV budget"):
            LLMEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, kv_cache_memory=1024))
        assert len(built) == 1
        pids = [p.pid for p in built[0]._procs]
        assert pids, "no follower was started"
        # close() joins (or kills and joins) its followers before the error reaches the caller
        assert not [pid for pid in pids if _running(pid)], "a follower outlived the failed start"
    finally:
        for r in built:
            r.close()
        torch.set_num_threads(threads)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_close_does_not_wait_on_a_frozen_follower(two):
    """A follower frozen (SIGSTOP: a hung device) when the engine is closed: close() sends "stop"
    with a short wait and then kills it by pid (helper-60: it waited out the 900 s start-up
    timeout, and the worker's stop with it)."""
    pid = two.runner._procs[0].pid
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    closer = threading.Thread(target=two.runner.close, daemon=True)
    closer.start()
    closer.join(30)
    took = time.monotonic() - t0
    if closer.is_alive():
        os.kill(pid, signal.SIGKILL)
        closer.join(30)
    assert took < 20, f"close() took {took:.0f} s with a frozen follower"
    assert not _running(pid)


def test_ctrl_c_reaching_the_followers_leaves_the_group_serving(two):
    """A terminal's Ctrl-C goes to the whole process group; the worker drains on it, which needs
    its followers: they ignore SIGINT (helper-60: they died and no running job was answered)."""
    two.add_request("a", [5, 6, 7], greedy(2))
    run(two, max_s=60)
    pid = two.runner._procs[0].pid
    os.kill(pid, signal.SIGINT)
    time.sleep(1.0)
    assert _running(pid)
    two.add_request("b", [5, 6, 7, 8], greedy(3))
    done = run(two, max_s=60)
    assert len(done["b"].seqs[0].output_token_ids) == 3 and two.runner.failure is None


def test_tp_settings_are_checked_before_anything_starts(tiny_model_dir, monkeypatch):
    """QWORKER_TP_EXTERNAL_FOLLOWERS=0 means no (it meant yes: any non-empty value did), and a
    QWORKER_TP_TIMEOUT_S that is not a positive finite number is refused by name before a
    follower is spawned (it failed later inside torch.distributed, or overflowed)."""
    import multiprocessing as mp

    from kernels.env import switch

    for value, want in (("", False), ("0", False), ("false", False), ("no", False), ("1", True), ("true", True)):
        monkeypatch.setenv("QWORKER_TP_EXTERNAL_FOLLOWERS", value)
        assert switch("QWORKER_TP_EXTERNAL_FOLLOWERS") is want
    monkeypatch.setenv("QWORKER_TP_EXTERNAL_FOLLOWERS", "maybe")
    with pytest.raises(ValueError, match="QWORKER_TP_EXTERNAL_FOLLOWERS"):
        switch("QWORKER_TP_EXTERNAL_FOLLOWERS")
    monkeypatch.setenv("QWORKER_TP_EXTERNAL_FOLLOWERS", "0")
    before = set(mp.active_children())
    for bad in ("0", "-1", "abc", "inf", "nan"):
        monkeypatch.setenv("QWORKER_TP_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="QWORKER_TP_TIMEOUT_S"):
            LLMEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, kv_cache_memory=4 << 20))
    assert set(mp.active_children()) == before, "a follower was spawned before the settings were checked"


def test_two_engines_at_once_give_all_the_cores_back(tiny_model_dir):
    """Two CPU tensor-parallel engines alive together, closed in turn: the process ends at the
    thread count it had before the first (helper-60: the second recorded the first's lowered
    count as its own "before" and left it)."""
    import torch

    before = torch.get_num_threads()
    try:
        a = LLMEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, kv_cache_memory=4 << 20, max_num_seqs=2))
        b = LLMEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, kv_cache_memory=4 << 20, max_num_seqs=2))
        a.runner.close()
        b.runner.close()
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


FOLLOWER_FAILS = '''
import multiprocessing as mp, os, signal, sys
from qworker.model import runner as runner_mod
real_init, real_alloc = runner_mod.ModelRunner.__init__, runner_mod.ModelRunner.allocate_kv_cache
in_follower = mp.current_process().name.startswith("qworker-tp-rank")
def alloc(self, *a):
    if in_follower and sys.argv[2] == "alloc":
        raise MemoryError("injected: the follower's device is full")
    return real_alloc(self, *a)
def init(self, *a, **k):
    if in_follower and sys.argv[2] == "killed":
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would while the model loads
    return real_init(self, *a, **k)
# spawn re-runs this module in the follower (with the parent's argv)
runner_mod.ModelRunner.allocate_kv_cache, runner_mod.ModelRunner.__init__ = alloc, init
if __name__ == "__main__":
    from qworker.engine import EngineConfig, LLMEngine
    try:
        LLMEngine(EngineConfig(model=sys.argv[1], tensor_parallel_size=2, kv_cache_memory=4 << 20))
    except Exception as e:
        print("START FAILED:", e)
        print("CHILDREN:", [p.pid for p in mp.active_children()])
    else:
        print("STARTED")
'''


@pytest.mark.parametrize(("fault", "reason"), [("alloc", "the follower's device is full"), ("killed", r"rank 1 \(pid \d+\) exited with status -9")])
def test_a_follower_that_fails_at_start_up_fails_the_start_with_its_reason(tiny_model_dir, tmp_path, fault, reason):
    """The follower's allocation error is the engine's start error, with its reason (helper-60:
    the engine started and failed at its first step, the reason only in the follower's log); a
    follower killed while it loads names its rank, pid and status (helper-111: "a rank exited")."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "follower_fails.py"
    script.write_text(FOLLOWER_FAILS)
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(script), str(tiny_model_dir), fault], cwd=root, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(root), "QWORKER_TP_TIMEOUT_S": "10"})
    assert "START FAILED" in r.stdout and re.search(reason, r.stdout), r.stdout + r.stderr[-3000:]
    assert "CHILDREN: []" in r.stdout


def test_cpu_ranks_share_the_threads_the_process_was_given_not_the_nodes_cores(tiny_model_dir, monkeypatch):
    """helper-124: rank threads were ``os.cpu_count() // world``; in a container that counts the
    node's cores, so a pod limited to 2 CPUs (OMP_NUM_THREADS=2, from the chart) on a 64-core node
    ran 32 threads a rank. Now the ranks split torch's thread count."""
    import torch

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # the node, as a container sees it
    torch.set_num_threads(2)  # the pod's limit
    try:
        e = LLMEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, kv_cache_memory=4 << 20, max_num_seqs=2))
        try:
            assert e.runner._threads == 1  # each rank's share of 2, not of 64
            e.add_request("a", [5, 6, 7], greedy(2))
            run(e, max_s=60)
        finally:
            e.runner.close()
    finally:
        torch.set_num_threads(before)
