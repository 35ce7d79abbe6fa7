"""``make test``: the whole suite as three pytest processes running at the same time.

Why several: on the 2-core machines CI runs on, one serial run takes ~30 minutes. ``tests/worker``
and the other broker-bound tests wait on the broker part of the time (group joins, rebalances,
outages, deadlines); the engine, kernel, bench and chart tests are CPU-bound on one thread each.
With the broker-bound group beside one CPU-bound group, the CPU-bound one ran ~250 s alone at the
end with a core idle (idle 2-core AVX2 EPYC: 1105 s wall; 1010 s and 719 s of CPU). So the
CPU-bound files are split over two processes, balanced by their recorded times
(``tests/durations.json``), and all three run side by side. The two cores are then busy all the
time, so the wall time follows the suite's total CPU time: splitting the broker-bound group in two
as well (each process with its own broker) gave no gain (Zen 4, 2026-12-07: 775 s and 1,430 s of
CPU in four processes, against 765 s and 1,357 s in three).

Why one intra-op thread each (``OMP_NUM_THREADS=1`` unless already set): several OpenMP teams of
two threads on two cores make every parallel region wait for a preempted partner thread (barriers
then cost a scheduler slice; CPU-heavy tests ran ~10x slower so). Tests that are about threads
set their own counts (the GEMM kernels' 2-thread tests pass ``threads=2``).

The first group's output streams as it runs (CI sees progress); the others' is kept and printed
whole after it, each with its wall and CPU time. The exit status is non-zero when any group
fails. ``python -m pytest`` on its own still runs everything serially.

``python tests/run_all.py --weights-from junit.xml`` updates ``tests/durations.json`` from a
pytest ``--junitxml`` report (of either group's files; the others keep their figures).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DURATIONS = ROOT / "tests" / "durations.json"
# what talks to the broker (folders and files); the rest is CPU-bound
BROKER_BOUND = ["tests/worker", "tests/telemetry", "tests/bench/test_bench_kafka_smoke.py"]


def _test_files() -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py"))


def _broker_bound(f: str) -> bool:
    return any(f == b or f.startswith(b + "/") for b in BROKER_BOUND)


def cpu_bound_files() -> list[str]:
    """Every test file outside BROKER_BOUND, relative to the root."""
    return [f for f in _test_files() if not _broker_bound(f)]


def broker_bound_files() -> list[str]:
    return [f for f in _test_files() if _broker_bound(f)]


def balance(files: list[str], seconds: dict[str, float], bins: int = 2) -> list[list[str]]:
    """Longest first into the least-loaded bin; a file without a recorded time counts as the
    median one (new files)."""
    default = statistics.median(seconds.values()) if seconds else 1.0
    loads, out = [0.0] * bins, [[] for _ in range(bins)]
    for f in sorted(files, key=lambda f: (-seconds.get(f, default), f)):
        i = loads.index(min(loads))
        loads[i] += seconds.get(f, default)
        out[i].append(f)
    return [sorted(b) for b in out]


def groups() -> dict[str, list[str]]:
    seconds = json.loads(DURATIONS.read_text())["seconds"] if DURATIONS.exists() else {}
    a, b = balance(cpu_bound_files(), seconds)
    return {"CPU-bound tests, part 1": a, "CPU-bound tests, part 2": b, "broker-bound tests": broker_bound_files()}


def weights_from(junit: Path) -> None:
    """Per-file seconds (setup, call and teardown) from a pytest junit report into DURATIONS."""
    per_file: Counter[str] = Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        while parts and not parts[-1].startswith("test_"):  # drop test classes
            parts.pop()
        if parts:
            per_file["/".join(parts) + ".py"] += float(case.get("time", 0))
    old = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {"note": "", "seconds": {}}
    seconds = {**old["seconds"], **{f: round(s) for f, s in per_file.items()}}  # files the report lacks keep theirs
    DURATIONS.write_text(json.dumps({"note": old["note"], "seconds": dict(sorted(seconds.items()))}, indent=1) + "\n")


def main(extra: list[str]) -> int:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    runs = {}
    for i, (name, args) in enumerate(groups().items()):
        log = None if i == 0 else tempfile.TemporaryFile()  # the first streams to our stdout
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *extra]
        print(f"===== {name}: {' '.join(cmd[1:])}", flush=True)
        runs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=None if log is None else subprocess.STDOUT), log)
    failed = []
    for name, (proc, log) in runs.items():
        # wait4 gives the group's CPU time (its own and its waited-for children's: workers, brokers),
        # which says how much of the two cores each group keeps busy
        _, status, usage = os.wait4(proc.pid, 0)
        rc = os.waitstatus_to_exitcode(status)
        proc.returncode = rc
        cpu = usage.ru_utime + usage.ru_stime
        sys.stdout.write(f"\n===== {name} (exit {rc}, done by {time.monotonic() - started:.0f} s, {cpu:.0f} s CPU) =====\n")
        sys.stdout.flush()
        if log is not None:
            log.seek(0)
            sys.stdout.buffer.write(log.read())
            sys.stdout.flush()
        if rc != 0:
            failed.append(f"{name} (exit {rc})")
    took = time.monotonic() - started
    print(f"\n===== {'FAILED: ' + ', '.join(failed) if failed else 'all groups passed'} in {took:.0f} s =====")
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--weights-from"]:
        weights_from(Path(sys.argv[2]))
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
