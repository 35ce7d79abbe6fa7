"""An adversarial pass over the third review's worker fixes: bad start-up settings, hostile
records, the stream's end marker and attempts. Each test failed before its fix (the docstrings
say how); through the real CLI, the real Tansu broker and the real or tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------ start-up: one line, exit 2
def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")}
    env.update({"QWORKER_HTTP_PORT": "-1", "QWORKER_BOOTSTRAP_SERVERS": "127.0.0.1:1", "QWORKER_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}, **extra)
    return env


def _bad_config_model(tmp: Path) -> Path:
    d = tmp / "broken-model"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"')  # cut short: not JSON
    return d


def _cases(tmp: Path, tiny: Path) -> dict[str, tuple[dict[str, str], str]]:
    cases: dict[str, tuple[dict[str, str], str]] = {
        "broken config.json": ({"QWORKER_MODEL": str(_bad_config_model(tmp))}, "QWORKER_MODEL="),
        # the tiny model's blocks are 4 KiB: 1e-9 of any machine's memory holds fewer than two
        "KV fraction under two blocks": ({"QWORKER_MODEL": str(tiny), "QWORKER_KV_CACHE_MEMORY": "0.000000001"}, "QWORKER_KV_CACHE_MEMORY="),
        "unknown device": ({"QWORKER_MODEL": str(tiny), "QWORKER_DEVICE": "tpu"}, "QWORKER_DEVICE="),
    }
    import torch

    if not torch.cuda.is_available():
        cases["cuda on a CPU machine"] = ({"QWORKER_MODEL": str(tiny), "QWORKER_DEVICE": "cuda"}, "QWORKER_DEVICE='cuda'")
    return cases


def test_engine_failures_at_start_are_one_line_and_exit_2(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Before: anything the engine raised while loading (a KV budget under two blocks, a CUDA
    device on a CPU machine - told as a pinned-memory error -, a device torch does not know, a
    config.json that is not JSON)
    left ``qworker run`` with a 30-line traceback and exit 1."""
    procs = {
        name: (subprocess.Popen([sys.executable, "-m", "qworker.cli", "run"], cwd=REPO, env=_clean_env(**env),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE), names)
        for name, (env, names) in _cases(tmp_path, tiny_model_dir).items()
    }
    for name, (p, names) in procs.items():
        out, err = p.communicate(timeout=240)
        lines = [ln for ln in err.decode().splitlines() if ln.strip() and "Warning" not in ln and not ln.startswith("  warnings.warn")]
        assert p.returncode == 2, (name, p.returncode, err.decode()[-2000:])
        assert "Traceback" not in err.decode(), (name, err.decode()[-2000:])
        assert len(lines) == 1 and lines[0].startswith("qworker: ") and names in lines[0], (name, lines)
