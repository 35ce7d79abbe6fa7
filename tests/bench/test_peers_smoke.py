"""bench/peers.py without the peers installed: qworker alone through the same path (its own
process, the job file, the result, the report) on the tiny model, and the comparison helpers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import peers  # noqa: E402
from qworker.model import linear  # noqa: E402


def test_qworker_only(tiny_model_dir, tmp_path, capsys, monkeypatch):
    def broken(*a):
        raise RuntimeError("no compiler here")

    # a peer whose setup fails is reported and skipped; the others still run
    monkeypatch.setattr(peers, "setup_llamacpp", broken)
    r = peers.main(["--model", str(tiny_model_dir), "--quick", "--peers", "qworker,llamacpp", "--num-requests", "4", "--max-output", "8",
                    "--kv-memory-mib", "8", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out")])
    files = sorted((tmp_path / "out").glob("peers-*.json"))
    assert len(files) == 1 and files[0].with_suffix(".png").exists()
    saved = json.loads(files[0].read_text())
    assert saved["commit"] and saved["machine"] and saved["command"]
    q = r["systems"]["qworker"]
    assert set(r["systems"]) == {"qworker"}
    assert len(q["tokens"]) == 4 and [len(t) for t in q["tokens"]] == [8] * 4 and "length_mismatch" not in q
    assert q["tokens_per_s"] == pytest.approx(r["workload"]["useful_output_tokens"] / q["seconds"])
    assert q["detail"]["linear_backend"] in linear.BACKENDS
    assert not (tmp_path / "cache" / peers.VLLM_PIN.replace("==", "-")).exists()  # nothing was set up
    assert "no compiler here" in r["failed"]["llamacpp"]
    printed = capsys.readouterr().out
    assert "| qworker |" in printed and "llamacpp did not run" in printed


def test_compare_and_peer_names(tmp_path):
    c = peers.compare([[1, 2, 3], [1, 2, 4], [5]], [[1, 2, 3], [1, 2, 3], [6]])
    assert c["identical"] == 1 and c["of"] == 3 and c["first_divergence"] == 1.0  # median of 2 and 0
    with pytest.raises(SystemExit):
        peers.main(["--peers", "qworker,nonesuch", "--cache-dir", str(tmp_path)])
    assert peers._req_name("protobuf!=6.30.*,>=5.29.6; platform_machine != 's390x'") == "protobuf"
    assert peers._req_name("mistral_common[image]>=1.11.6") == "mistral-common"


def test_several_dtypes_one_run(tiny_model_dir, tmp_path, capsys):
    """``--dtype a,b``: one row per system and dtype, each peer compared with qworker of its own
    dtype, and the CPU (model, flags) named in the report."""
    r = peers.main(["--model", str(tiny_model_dir), "--quick", "--peers", "qworker", "--dtype", "float32,auto", "--num-requests", "2",
                    "--max-output", "4", "--kv-memory-mib", "8", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "out")])
    assert set(r["systems"]) == {"qworker float32", "qworker auto"}
    assert r["systems"]["qworker float32"]["tokens"] == r["systems"]["qworker auto"]["tokens"]  # auto is fp32 on CPU
    assert r["cpu"]["kernel_isa"] in ("avx512", "avx2", "generic") and isinstance(r["cpu"]["flags"], list)
    printed = capsys.readouterr().out
    assert "| qworker float32 |" in printed and "CPU: " in printed
