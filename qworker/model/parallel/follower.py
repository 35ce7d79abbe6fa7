"""A follower rank: loads its shard, then runs every command the leader broadcasts until "stop".

Started two ways: by the leader with multiprocessing spawn (one per local device, :func:`spawned`),
or as its own process on another node (``python -m qworker.model.parallel.follower``) with
torchrun's environment: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` (and
``LOCAL_RANK`` for the device), or a LeaderWorkerSet pod's ``LWS_LEADER_ADDRESS``,
``LWS_WORKER_INDEX``, ``LWS_GROUP_SIZE``. The model settings come from the leader's first broadcast, so a
follower needs no model flags. A follower exits when the leader says "stop", when a collective
with the leader fails (the leader died: its sockets closed), and, when spawned, as soon as its
parent process is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger("qworker.model.parallel.follower")
# a follower logs its step and all-reduce times this often (seconds)
REPORT_INTERVAL_S = 60.0


def _watch_parent(parent_pid: int) -> None:
    """Exits this process as soon as the leader process is gone (reparented), whatever it is doing."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def spawned(rank: int, world: int, addr: str, port: int, device: str, parent_pid: int, timeout_s: float, threads: int | None,
            log_level: int = logging.INFO) -> None:
    """The multiprocessing entry point of a locally spawned follower (its log lines go to the
    worker's stderr, at the worker's level). It ignores SIGINT: a Ctrl-C reaches the terminal's
    whole process group, and the worker drains on it, which needs its followers; they end with
    the worker (its "stop", or its exit). Not in the first ~0.3 s, while the spawned interpreter
    imports this module: the leader cannot pass a blocked or ignored SIGINT through
    multiprocessing's spawn, and a Ctrl-C then fails the start. SIGTERM keeps its default:
    multiprocessing's exit handler ends daemon children with it and then waits for them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    if threads:
        import torch

        torch.set_num_threads(threads)
    sys.exit(serve(rank, world, addr, port, device, timeout_s))


def serve(rank: int, world: int, addr: str, port: int, device: str, timeout_s: float | None = None) -> int:
    from qworker.model.loader import resolve_device
    from qworker.model.parallel.build import TPRank
    from qworker.model.parallel.comm import Comm
    from qworker.model.runner import ModelRunner

    dev = resolve_device(device)
    comm = Comm(rank, world, addr, port, dev, timeout_s)
    try:
        init = comm.broadcast()
        ok, runner = _reported(comm, rank, lambda: ModelRunner(init["model_dir"], device, init["dtype"], init["max_model_len"],
                                                               init["kv_cache_dtype"], init.get("kernel_backend"),
                                                               tp=TPRank(rank, world, comm.all_reduce)))
        if not ok:
            return 1
        steps, step_s, last = 0, 0.0, time.monotonic()
        while True:
            cmd, arg = comm.broadcast()
            if cmd == "step":
                t0 = time.perf_counter()
                runner.execute(arg)
                step_s += time.perf_counter() - t0
                steps += 1
                if time.monotonic() - last > REPORT_INTERVAL_S:
                    log.info("tp rank %d: %d steps, %.1f ms/step, all-reduce %.1f ms/step", rank, steps, 1e3 * step_s / steps,
                             1e3 * comm.allreduce_seconds / steps)
                    last = time.monotonic()
            elif cmd == "apply":
                runner.kv.apply(*arg)
            elif cmd == "alloc":
                if not _reported(comm, rank, lambda: runner.allocate_kv_cache(*arg))[0]:
                    return 1
            elif cmd == "stats":
                comm.gather({"steps": steps, "step_seconds": step_s, "allreduce_seconds": comm.allreduce_seconds,
                             "allreduce_calls": comm.allreduce_calls})
            elif cmd == "stop":
                return 0
            # "ping": the leader is alive and idle
    except Exception as e:  # noqa: BLE001 - a broken group: the leader is gone or failed
        log.error("tp rank %d: leaving: %s", rank, e)
        return 2
    finally:
        comm.close()


def _reported(comm, rank: int, step):
    """Runs a start-up ``step`` (loading the model, allocating the KV cache) and reports to the
    leader None or its error, which the leader raises; ``(ok, step's result)``."""
    try:
        result, status = step(), None
    except Exception as e:  # noqa: BLE001 - reported to the leader
        result, status = None, f"rank {rank}: {type(e).__name__}: {e}"
    comm.gather(status)
    return status is None, result


# a LeaderWorkerSet pod's own variables, where torchrun's are not set
LWS_NAMES = {"RANK": "LWS_WORKER_INDEX", "WORLD_SIZE": "LWS_GROUP_SIZE", "MASTER_ADDR": "LWS_LEADER_ADDRESS"}


def rendezvous_env(name: str) -> str:
    """torchrun's variable ``name``, else its LeaderWorkerSet equivalent; KeyError if neither."""
    env = os.environ
    if env.get(name):
        return env[name]
    if name in LWS_NAMES and env.get(LWS_NAMES[name]):
        return env[LWS_NAMES[name]]
    raise KeyError(name)


def main() -> int:
    """``python -m qworker.model.parallel.follower``: a follower on another node (torchrun env)."""
    logging.basicConfig(level=os.environ.get("QWORKER_LOG_LEVEL", "INFO").upper())
    env = os.environ
    try:
        rank, world = int(rendezvous_env("RANK")), int(rendezvous_env("WORLD_SIZE"))
        addr, port = rendezvous_env("MASTER_ADDR"), int(rendezvous_env("MASTER_PORT"))
    except (KeyError, ValueError) as e:
        print(f"qworker follower: set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT ({e})", file=sys.stderr)
        return 2
    if rank < 1:
        print("qworker follower: RANK must be >= 1 (rank 0 is the worker)", file=sys.stderr)
        return 2
    device = env.get("QWORKER_DEVICE") or "auto"
    if device in ("auto", "cuda") and "LOCAL_RANK" in env:
        import torch

        if torch.cuda.is_available():
            device = f"cuda:{int(env['LOCAL_RANK'])}"
    return serve(rank, world, addr, port, device)


if __name__ == "__main__":
    sys.exit(main())
