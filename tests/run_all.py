"""``make test``: the whole suite as two pytest processes running at the same time.

Why two: on the 2-core machines CI runs on, ``tests/worker`` (about 45% of a serial run) spends
most of its time waiting on the broker (group joins, rebalances, outages, deadlines) and keeps
about half a core busy, while the engine and kernel tests are CPU-bound. Side by side they finish
in about the time of the longer one (idle 2-core AVX2 EPYC: 18 min serially, 13 min so).

Why one intra-op thread each (``OMP_NUM_THREADS=1`` unless already set): two OpenMP teams of two
threads on two cores make every parallel region wait for a preempted partner thread (barriers
then cost a scheduler slice; CPU-heavy tests ran ~10x slower so). Tests that are about threads
set their own counts (the GEMM kernels' 2-thread tests pass ``threads=2``).

The first group's output streams as it runs (CI sees progress); the second's is kept and printed
whole after it. The exit status is non-zero when either group fails. ``python -m pytest`` on its
own still runs everything serially.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the broker-bound group takes the smaller directories too (bench smoke runs, telemetry, chart), so
# both finish at about the same time (serial, idle 2-core EPYC: worker 458 s, engine 405 s,
# kernels 119 s, bench 65 s, telemetry 14 s, deploy 8 s); a new directory joins the first group
BROKER_BOUND = ["tests/worker", "tests/bench", "tests/telemetry", "tests/deploy"]
GROUPS = {
    "engine, kernels and the rest": ["tests", *(f"--ignore={d}" for d in BROKER_BOUND)],
    " ".join(BROKER_BOUND): BROKER_BOUND,
}


def main(extra: list[str]) -> int:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    runs = {}
    for i, (name, args) in enumerate(GROUPS.items()):
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
        sys.stdout.write(f"\n===== {name} (exit {rc}, {time.monotonic() - started:.0f} s wall, {cpu:.0f} s CPU) =====\n")
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
    sys.exit(main(sys.argv[1:]))
