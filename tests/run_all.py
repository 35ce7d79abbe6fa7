"""``make test``: the whole suite as two pytest processes running at the same time.

Why two: on the 2-core machines CI runs on, ``tests/worker`` (about 45% of a serial run) spends
most of its time waiting on the broker (group joins, rebalances, outages, deadlines) and keeps
about half a core busy, while the rest of the suite is CPU-bound. Side by side they finish in
about the time of the longer one.

Why one intra-op thread each (``OMP_NUM_THREADS=1`` unless already set): two OpenMP teams of two
threads on two cores make every parallel region wait for a preempted partner thread (barriers
then cost a scheduler slice; CPU-heavy tests ran ~10x slower so). Tests that are about threads
set their own counts (the GEMM kernels' 2-thread tests pass ``threads=2``).

Each group's output is printed whole, one after the other; the exit status is non-zero when
either group fails. ``python -m pytest`` on its own still runs everything serially.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GROUPS = {
    "tests/worker": ["tests/worker"],
    "everything else": ["tests", "--ignore=tests/worker"],
}


def main(extra: list[str]) -> int:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    runs = {}
    for name, args in GROUPS.items():
        log = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, *extra]
        runs[name] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log)
    failed = []
    for name, (proc, log) in runs.items():
        rc = proc.wait()
        log.seek(0)
        sys.stdout.write(f"\n===== {name} (exit {rc}) =====\n")
        sys.stdout.flush()
        sys.stdout.buffer.write(log.read())
        sys.stdout.flush()
        if rc != 0:
            failed.append(f"{name} (exit {rc})")
    took = time.monotonic() - started
    print(f"\n===== {'FAILED: ' + ', '.join(failed) if failed else 'all groups passed'} in {took:.0f} s =====")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
