"""``QWORKER_KV_CACHE_MEMORY`` takes bytes or a fraction of memory, and a bad value is one line.

The GPU example's ``kvCacheMemory: "0.90"`` (vLLM's ``gpu_memory_utilization``) was read as a
byte count, 0, and the pod died after loading the model with a long traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from qworker.config import WorkerSettings
from qworker.host_memory import available_memory, cpu_kv_budget
from qworker.model.runner import ModelRunner

from .conftest import REPO

GiB = 1 << 30


@pytest.mark.parametrize("given", ["0.90", "0.9", " .9 ", "0.90"])
def test_a_fraction_is_a_share_of_memory_not_bytes(given: str) -> None:
    s = WorkerSettings.from_env({"QWORKER_KV_CACHE_MEMORY": given})
    assert s.kv_cache_memory == pytest.approx(0.9)
    cfg = s.engine_config()
    assert "kv_cache_memory" not in cfg  # the engine sizes the pool from the fraction, per device
    assert cfg["gpu_memory_utilization"] == pytest.approx(0.9)  # CUDA: vLLM's meaning
    assert cfg["cpu_kv_cache_memory"] > 0
    # CPU: what the engine's runner then budgets for the pool
    cpu = SimpleNamespace(device=torch.device("cpu"))
    assert ModelRunner.device_kv_budget(cpu, None, cfg["gpu_memory_utilization"], cfg["cpu_kv_cache_memory"]) == cfg["cpu_kv_cache_memory"]


def test_bytes_and_units_still_mean_bytes() -> None:
    assert WorkerSettings.from_env({"QWORKER_KV_CACHE_MEMORY": "512MiB"}).engine_config()["kv_cache_memory"] == 512 << 20
    assert WorkerSettings.from_env({"QWORKER_KV_CACHE_MEMORY": "2G"}).kv_cache_memory == 2 * 10**9
    assert WorkerSettings.from_env({"QWORKER_KV_CACHE_MEMORY": "1073741824"}).kv_cache_memory == GiB
    assert WorkerSettings(kv_cache_memory=GiB).engine_config()["kv_cache_memory"] == GiB
    assert WorkerSettings(kv_cache_memory=1.0).engine_config()["gpu_memory_utilization"] == 1.0


def test_cpu_fraction_is_of_the_memory_left_after_the_weights(tmp_path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    assert cpu_kv_budget(0.5, tmp_path, available=11_000) == 5_000
    assert cpu_kv_budget(0.5, None, available=11_000) == 5_500
    assert cpu_kv_budget(0.9, tmp_path, available=500) == 0  # nothing left: the engine then says so


def test_available_memory_prefers_the_containers_headroom(tmp_path) -> None:
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), v1.mkdir()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    assert available_memory(v2, v1, meminfo) == 8_000_000 * 1024  # no cgroup limit: the machine's
    (v2 / "memory.max").write_text("4294967296\n")
    (v2 / "memory.current").write_text("1073741824\n")
    assert available_memory(v2, v1, meminfo) == 3 * GiB  # a pod's limit less its usage
    (v2 / "memory.max").write_text("max\n")
    assert available_memory(v2, v1, meminfo) == 8_000_000 * 1024


@pytest.mark.parametrize("given, says", [
    ("0", "too small"), ("0.0", "in (0, 1]"), ("1.5", "in (0, 1]"), ("-0.5", "bytes"), ("abc", "bytes"), ("100", "too small"),
])
def test_a_bad_value_names_the_variable(given: str, says: str) -> None:
    with pytest.raises(ValidationError) as e:
        WorkerSettings.from_env({"QWORKER_KV_CACHE_MEMORY": given})
    line = WorkerSettings.explain(e.value)
    assert "QWORKER_KV_CACHE_MEMORY" in line and says in line and "\n" not in line


@pytest.mark.parametrize("var, value", [
    ("QWORKER_BLOCK_SIZE", "3"), ("QWORKER_DTYPE", "fp8"), ("QWORKER_KV_CACHE_DTYPE", "int8"), ("QWORKER_MAX_NUM_SEQS", "0"),
])
def test_engine_rules_are_checked_with_the_settings(var: str, value: str) -> None:
    with pytest.raises(ValidationError) as e:
        WorkerSettings.from_env({var: value})
    line = WorkerSettings.explain(e.value)
    assert line.startswith(f"invalid settings: {var}: ") and "\n" not in line


def test_qworker_run_with_a_bad_setting_is_one_line_and_exit_2(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")}
    env.update({"QWORKER_KV_CACHE_MEMORY": "0", "QWORKER_MODEL": str(tmp_path), "QWORKER_HTTP_PORT": "-1", "QWORKER_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    r = subprocess.run([sys.executable, "-m", "qworker.cli", "run"], cwd=REPO, env=env, capture_output=True, timeout=120)
    err = r.stderr.decode().strip()
    assert r.returncode == 2, err
    assert len(err.splitlines()) == 1 and "QWORKER_KV_CACHE_MEMORY" in err and "Traceback" not in err, err


def test_a_kv_cache_past_the_hosts_memory_is_refused_before_it_is_filled(tiny_model_dir) -> None:
    """helper-85: QWORKER_KV_CACHE_MEMORY=1T on a CPU had the machine's OOM killer end the worker
    (11 GB resident when it struck); now the engine refuses a KV pool its host memory cannot hold,
    naming the settings (a CPU worker's swap space is not counted: its pages are never written
    until a swap-out, and cost nothing until then)."""
    from qworker.engine import EngineConfig, LLMEngine

    too_big = 4 * available_memory() + 64 * GiB  # far past it, however much frees up meanwhile
    with pytest.raises(ValueError, match="QWORKER_KV_CACHE_MEMORY / swap_space"):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=too_big, swap_space=0))


@pytest.mark.parametrize("var,value", [("QWORKER_CPU_FUSED_FORWARD", "maybe"), ("QWORKER_GC_FREEZE", "off-ish"),
                                       ("QWORKER_CPU_AMX", "2"), ("QWORKER_TP_TIMEOUT_S", "-5")])
def test_qworker_run_refuses_a_switch_that_is_neither_yes_nor_no(var: str, value: str, model_dir) -> None:
    """helper-85: the QWORKER_CPU_* / GC switches were off only for exactly "0" (so "false" left them
    on) and anything else was silently "on"; QWORKER_TP_TIMEOUT_S was checked only with tensor
    parallelism. Now `run` checks them all before loading a model: one line, exit 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")}
    env.update({var: value, "QWORKER_MODEL": str(model_dir), "QWORKER_HTTP_PORT": "-1", "QWORKER_BOOTSTRAP_SERVERS": "127.0.0.1:1"})
    r = subprocess.run([sys.executable, "-m", "qworker.cli", "run"], cwd=REPO, env=env, capture_output=True, timeout=120)
    err = r.stderr.decode().strip()
    assert r.returncode == 2, err
    assert len(err.splitlines()) == 1 and var in err and "Traceback" not in err, err


def test_switches_read_yes_and_no_words(monkeypatch) -> None:
    from kernels.env import switch

    for raw, want in (("", True), ("1", True), ("on", True), ("YES", True), ("0", False), ("false", False), (" off ", False)):
        monkeypatch.setenv("QWORKER_CPU_FUSED_FORWARD", raw)
        assert switch("QWORKER_CPU_FUSED_FORWARD") is want, raw


@pytest.mark.parametrize("var,value", [("QWORKER_SWAP_SPACE", "4.0"), ("QWORKER_SWAP_SPACE", "1.5"), ("QWORKER_SWAP_SPACE", "0.5b"),
                                       ("QWORKER_GRAMMAR_CACHE_BYTES", "1.5")])
def test_a_byte_count_with_a_fraction_and_no_unit_is_refused(var: str, value: str) -> None:
    """helper-99: these were truncated to whole bytes (4.0, vLLM's 4 GiB of swap, became 4 bytes;
    0.5 turned swapping off without a word)."""
    with pytest.raises(ValidationError) as e:
        WorkerSettings.from_env({var: value})
    line = WorkerSettings.explain(e.value)
    assert var in line and "a fraction needs a unit" in line and "\n" not in line
    assert WorkerSettings.from_env({var: "1.5GiB"}).model_dump()[var.removeprefix("QWORKER_").lower()] == int(1.5 * GiB)


@pytest.mark.parametrize("positions", [0, 1, 2])
def test_a_model_context_of_under_two_positions_is_one_line_and_two_still_warms_up(positions, tiny_model_dir, tmp_path) -> None:
    """helper-99: max_position_embeddings 0 or 2 crashed the worker's warm-up (a 3-token prompt)
    with a 120-line traceback. Now under 2 is refused by name (exit 2); 2 warms up on one token."""
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")}
    env.update({"QWORKER_MODEL": str(path), "QWORKER_HTTP_PORT": "-1", "QWORKER_BOOTSTRAP_SERVERS": "127.0.0.1:1", "QWORKER_DEVICE": "cpu",
                "QWORKER_KV_CACHE_MEMORY": "64MiB"})
    r = subprocess.run([sys.executable, "-m", "qworker.cli", "run"], cwd=REPO, env=env, capture_output=True, timeout=180)
    err = r.stderr.decode().strip()
    assert "Traceback" not in err and "InvalidRequestError" not in err, err
    if positions == 2:  # past the warm-up: it stops only at the broker no one listens on
        assert r.returncode == 2 and err.splitlines()[-1].startswith("qworker: cannot reach Kafka at '127.0.0.1:1'"), err
    else:
        assert r.returncode == 2 and len(err.splitlines()) == 1 and "max_position_embeddings must be a whole number >= 2" in err, err


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_cancel_ttl_that_is_not_finite_is_refused_by_name(value: str) -> None:
    """helper-122: QWORKER_CANCEL_TTL_S=inf was accepted; the cancel reader then died on int(inf)
    without a log line, and /healthz failed for good: a liveness restart loop. Now refused by
    name before anything starts (a finite TTL past the epoch reads from the topic's beginning:
    test_a_cancel_ttl_past_the_epoch_reads_from_the_beginning)."""
    with pytest.raises(ValidationError) as e:
        WorkerSettings.from_env({"QWORKER_CANCEL_TTL_S": value})
    line = WorkerSettings.explain(e.value)
    assert line.startswith("invalid settings: QWORKER_CANCEL_TTL_S: ") and "\n" not in line
    assert WorkerSettings.from_env({"QWORKER_CANCEL_TTL_S": "1e10"}).cancel_ttl_s == 1e10
