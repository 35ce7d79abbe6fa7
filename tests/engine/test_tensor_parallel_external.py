"""Tensor parallelism with a follower started on its own, as on another node: ``python -m
qworker.model.parallel.follower`` with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and the leader told not to spawn (``QWORKER_TP_EXTERNAL_FOLLOWERS``). The follower
takes the model settings from the leader's first broadcast, serves greedy steps identical to one
rank, and exits 0 on the leader's "stop"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from qworker.engine import EngineConfig, LLMEngine, SamplingParams
from qworker.model.parallel.comm import free_port
from tests.engine.engine_support import outputs, run
from tests.engine.family_models import build_family_model

REPO = Path(__file__).resolve().parents[2]


def test_external_follower_serves_and_stops(tmp_path, model_dir, monkeypatch):
    path = build_family_model("llama", tmp_path / "m", model_dir, hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
                              intermediate_size=95)
    port = free_port()
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "QWORKER_DEVICE": "cpu",
           "QWORKER_TP_TIMEOUT_S": "30", "OMP_NUM_THREADS": "1"}
    log = tmp_path / "follower.log"
    with open(log, "wb") as out:
        follower = subprocess.Popen([sys.executable, "-m", "qworker.model.parallel.follower"], env=env, cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT)
    try:
        for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
            monkeypatch.setenv(k, env[k])
        monkeypatch.setenv("QWORKER_TP_EXTERNAL_FOLLOWERS", "1")
        monkeypatch.setenv("QWORKER_TP_TIMEOUT_S", "30")
        prompts = ["The capital of France is", "def fibonacci(n):"]
        got, want = {}, {}
        for tp, into in ((2, got), (1, want)):
            e = LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=tp, kv_cache_memory=16 << 20))
            try:
                for i, p in enumerate(prompts):
                    e.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
                into.update({k: outputs(r) for k, r in run(e, max_s=120).items()})
            finally:
                if tp > 1:
                    assert e.runner._procs == []  # nothing spawned: the follower is external
                    e.runner.close()
        assert got == want
        assert follower.wait(30) == 0, log.read_text()[-2000:]
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait(10)


def test_external_leader_needs_the_rendezvous(tmp_path, model_dir, monkeypatch):
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("QWORKER_TP_EXTERNAL_FOLLOWERS", "1")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=2))


SLOW_FOLLOWER = '''
import sys, time
from qworker.model import runner as runner_mod
real = runner_mod.ModelRunner.__init__
def slow(self, *a, **kw):
    print("FOLLOWER LOADING", flush=True)
    time.sleep(120)
    return real(self, *a, **kw)
runner_mod.ModelRunner.__init__ = slow
from qworker.model.parallel.follower import main
sys.exit(main())
'''


def test_an_external_follower_killed_while_loading_fails_the_start(tmp_path, tiny_model_dir, monkeypatch):
    """rank 0 cannot see the process of a rank on another node: a follower killed while it loads
    the model (an OOM kill, a node lost) is seen by its heartbeat stopping, and the start fails
    within the silence limit (helper-60: the leader waited out the 900 s start-up timeout)."""
    import signal
    import time

    from qworker.model.parallel import comm as cm

    port = free_port()
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "QWORKER_DEVICE": "cpu",
           "QWORKER_TP_TIMEOUT_S": "3", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    script = tmp_path / "slow_follower.py"
    script.write_text(SLOW_FOLLOWER)
    follower = subprocess.Popen([sys.executable, str(script)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed = []

    def kill_when_loading():
        for line in follower.stdout:
            if "FOLLOWER LOADING" in line:
                time.sleep(1)
                follower.send_signal(signal.SIGKILL)
                killed.append(time.monotonic())
                return

    import threading

    threading.Thread(target=kill_when_loading, daemon=True).start()
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"):
        monkeypatch.setenv(k, env[k])
    monkeypatch.setenv("QWORKER_TP_EXTERNAL_FOLLOWERS", "1")
    monkeypatch.setenv("QWORKER_TP_TIMEOUT_S", "3")
    try:
        with pytest.raises(RuntimeError, match="rank 1 went silent"):
            LLMEngine(EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, kv_cache_memory=4 << 20))
        assert killed and time.monotonic() - killed[0] < 10 * cm.HEARTBEAT_S + 15
    finally:
        if follower.poll() is None:
            follower.kill()
        follower.wait(30)
