"""The leader's side of tensor parallelism: a model runner the engine calls as it calls
:class:`~qworker.model.runner.ModelRunner`, driving the follower ranks.

Rank 0 is the engine's process: it holds rank 0's shard and the only LM head. Each call that
touches the model (KV allocation, a step, a step's block moves) is first broadcast to the
followers, which run the same thing on their shards, their KV pools laid out block for block as
the leader's (one block manager, on the leader, for all ranks).

Failure is fatal, fast and never a hang: before every command the locally spawned followers are
checked (their process sentinels), a watcher thread notices a death while idle, every collective
has a timeout, and any of these raises :class:`ExecutorFailed` (also kept in ``failure`` for an
idle engine to see). While idle the leader pings the followers every few seconds, so a follower
never waits out its timeout on a healthy leader and a dead remote follower is noticed.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
import weakref

import torch

from kernels.env import switch
from qworker.model.batch import Batch
from qworker.model.loader import load_config, resolve_device
from qworker.model.parallel import comm as cm
from qworker.model.parallel.build import TPRank, check_supported
from qworker.model.parallel.errors import ExecutorFailed
from qworker.model.parallel.follower import rendezvous_env, spawned
from qworker.model.runner import ModelRunner

log = logging.getLogger(__name__)
PING_INTERVAL_S = 5.0
STOP_WAIT_S = 5.0  # close() waits this long at most for the followers to take its "stop"


def follower_devices(device: torch.device, world: int) -> list[str]:
    """The devices of ranks 1..world-1 on this host: the next CUDA devices after the leader's, or cpu."""
    if device.type != "cuda":
        return ["cpu"] * (world - 1)
    first = device.index or 0
    count = torch.cuda.device_count()
    if first + world > count:
        raise ValueError(f"tensor_parallel_size={world} from cuda:{first} needs {first + world} CUDA devices; this host has {count}")
    return [f"cuda:{first + r}" for r in range(1, world)]


class _KV:
    """``runner.kv`` as the engine uses it: block moves are applied on every rank."""

    def __init__(self, owner: ParallelRunner):
        self._owner = owner

    def apply(self, swap_out, swap_in, copy) -> None:
        self._owner._command("apply", (swap_out, swap_in, copy))
        self._owner.local.kv.apply(swap_out, swap_in, copy)

    def __getattr__(self, name):
        return getattr(self._owner.local.kv, name)


class ParallelRunner:
    """``tensor_parallel_size`` ranks behind the ModelRunner interface. With ``external=True`` the
    followers are not spawned here: they join the rendezvous at ``MASTER_ADDR:MASTER_PORT`` on
    their own (``python -m qworker.model.parallel.follower``, other nodes)."""

    def __init__(self, world: int, model_dir: str, device: str = "auto", dtype: str = "auto", max_model_len: int | None = None,
                 kv_cache_dtype: str = "auto", kernel_backend: str | None = None, *, external: bool | None = None,
                 timeout_s: float | None = None):
        if world < 2:
            raise ValueError(f"ParallelRunner needs tensor_parallel_size >= 2, got {world}")
        external = switch("QWORKER_TP_EXTERNAL_FOLLOWERS") if external is None else external
        timeout_s = timeout_s or cm.timeout_s()  # checked before anything starts
        check_supported(load_config(model_dir), world)  # before anything starts
        dev = resolve_device(device)
        self.world = world
        self.failure: ExecutorFailed | None = None
        self._lock = threading.Lock()
        self._last_command = time.monotonic()
        self._procs: list[mp.process.BaseProcess] = []
        self._closed = False
        self._threads: int | None = None  # rank 0's torch threads on CPU
        self.comm: cm.Comm | None = None
        self.step_seconds = 0.0
        self.steps = 0
        if external:  # the rendezvous on this host's MASTER_PORT; followers find it at MASTER_ADDR
            try:
                addr, port = rendezvous_env("MASTER_ADDR"), int(rendezvous_env("MASTER_PORT"))
                group = int(rendezvous_env("WORLD_SIZE"))
            except KeyError as e:
                raise ValueError(f"external tensor-parallel followers need {e.args[0]} (or its LWS_* equivalent) set") from None
            if group != world:
                raise ValueError(f"tensor_parallel_size={world}, but the group's WORLD_SIZE is {group}")
        else:
            addr, port = "127.0.0.1", cm.free_port()
            devices = follower_devices(dev, world)
            threads = None
            if dev.type == "cpu":  # the ranks share the host's cores (restored by close())
                threads = max(1, _host_threads() // world)
                self._threads = threads
                _share_cores(threads)
        # a runner dropped unclosed (LLM deleted) still kills its followers and gives the cores back
        self._finalizer = weakref.finalize(self, _release, self._procs, self._threads is not None)
        if not external:
            ctx = mp.get_context("spawn")
            try:
                for rank in range(1, world):
                    p = ctx.Process(target=spawned, args=(rank, world, addr, port, devices[rank - 1], os.getpid(), timeout_s, threads,
                                                          logging.getLogger().getEffectiveLevel()),
                                    name=f"qworker-tp-rank{rank}", daemon=True)
                    p.start()
                    self._procs.append(p)
            except BaseException:
                self._finalizer()  # the ones started killed, the cores given back
                raise
        try:
            self.comm = cm.Comm(0, world, addr, port, dev, timeout_s, exited=self._exited)
            self.comm.broadcast({"model_dir": model_dir, "dtype": dtype, "max_model_len": max_model_len,
                                 "kv_cache_dtype": kv_cache_dtype, "kernel_backend": kernel_backend})
            error = None
            try:
                self.local = ModelRunner(model_dir, device, dtype, max_model_len, kv_cache_dtype, kernel_backend,
                                         tp=TPRank(0, world, self.comm.all_reduce))
            except Exception as e:  # noqa: BLE001 - the followers still wait for the gather
                error = e
            statuses = self.comm.gather(None)
            if error is not None:
                raise error
            bad = [s for s in statuses if s]
            if bad:
                raise ValueError("a tensor-parallel rank did not load the model: " + "; ".join(bad))
        except BaseException:
            self.close()
            raise
        self.kv = None
        self._watcher = threading.Thread(target=_watch, args=(weakref.ref(self),), name="qworker-tp-watch", daemon=True)
        self._watcher.start()
        log.info("tensor parallel: %d ranks (%s), followers %s", world, "gloo" if dev.type == "cpu" else "nccl",
                 "external" if external else [p.pid for p in self._procs])

    # -- the ModelRunner surface ------------------------------------------------------------------
    def __getattr__(self, name):  # device, dtype, config, model, max_model_len, block_bytes, ...
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        raise ValueError("LoRA adapters are not supported with tensor_parallel_size > 1")

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        """Every rank allocates its share; a rank that cannot (its device has less free memory
        than rank 0's, which sized the pool) fails the start with its reason."""
        with self._lock:
            self._send("alloc", (num_blocks, num_cpu_blocks, block_size))
            error = None
            try:
                self.local.allocate_kv_cache(num_blocks, num_cpu_blocks, block_size)
            except Exception as e:  # noqa: BLE001 - the followers still report theirs
                error = e
            try:
                statuses = self.comm.gather(None, self.comm.timeout_s)
            except RuntimeError as e:
                raise self._fail(f"allocating the KV cache: {e}") from e
        if error is not None:
            raise error
        bad = [s for s in statuses if s]
        if bad:
            raise self._fail("a tensor-parallel rank could not allocate its KV cache: " + "; ".join(bad))
        self.kv = _KV(self)

    def execute(self, batch: Batch) -> torch.Tensor:
        with self._lock:
            self._check()
            if self._threads is not None and torch.get_num_threads() != self._threads:
                torch.set_num_threads(self._threads)  # the count is per thread: the engine's may be new
            t0 = time.perf_counter()
            try:
                self.comm.broadcast(("step", batch), self.comm.timeout_s)
            except BaseException as e:  # a peer closed its connection, a timeout, or an interrupt
                failure = self._fail(f"a step's command failed: {e!r}")  # between the size and the bytes
                if isinstance(e, Exception):
                    raise failure from e
                raise
            calls = self.comm.allreduce_calls
            try:
                logits = self.local.execute(batch)
            except ExecutorFailed:
                raise
            except Exception as e:  # noqa: BLE001 - a collective failed, or this rank's forward broke off
                if not self._finish_failed_step(batch, self.comm.allreduce_calls - calls):
                    raise self._fail(f"a step failed: {e!r}") from e
                raise  # the ranks are in step again: the engine recovers as with one rank
            except BaseException as e:  # an interrupt mid-step: the followers may be inside an
                # all-reduce this rank never joins, so the next step would hang or pair wrong sums
                self._fail(f"a step was interrupted: {e!r}")
                raise
            self.step_seconds += time.perf_counter() - t0
            self.steps += 1
            self._last_command = time.monotonic()
            return logits

    def _finish_failed_step(self, batch: Batch, done: int) -> bool:
        """This rank's forward raised after ``done`` of the step's all-reduces, the group itself
        sound: the followers wait inside the next one. Joins every one left with zeros (each
        layer all-reduces twice: ``o``, then ``down`` or the MoE block), so the followers end the
        step (their writes to its blocks are garbage, but the engine recomputes every sequence
        the step touched) and wait for the next command. False where the ranks cannot be brought
        back in step (a collective failed). Every all-reduce is of the hidden width in the
        activation dtype (the last one seen says so; before any, the model does)."""
        c = self.comm
        if c.broken:
            return False
        m = self.local.model
        width, dtype = c.last_reduce or (m.embed.shape[1], m.act_dtype)
        tokens = sum(len(ch.token_ids) for ch in batch.chunks)
        try:
            for _ in range(2 * self.local.model.num_layers - done):
                c.all_reduce(torch.zeros(tokens, width, dtype=dtype, device=self.local.device))
        except Exception:  # noqa: BLE001 - reported by the caller as the step's failure
            return False
        log.warning("tensor parallel: this rank's forward failed after %d all-reduces; the followers were stepped past it", done)
        return True

    def rank_stats(self) -> list[dict]:
        """Each rank's cumulative step and all-reduce time (rank 0 first); a collective."""
        mine = {"steps": self.steps, "step_seconds": self.step_seconds, "allreduce_seconds": self.comm.allreduce_seconds,
                "allreduce_calls": self.comm.allreduce_calls}
        with self._lock:
            self._send("stats", None)
            try:
                others = self.comm.gather(None)
            except RuntimeError as e:
                raise self._fail(f"a collective failed: {e}") from e
        return [mine, *others[1:]]

    def stats(self) -> dict:
        """Rank 0's counters, for the engine's stats (no collective: safe to call any time)."""
        c = self.comm
        return {"tp_size": self.world, "tp_steps": self.steps, "tp_step_seconds": self.step_seconds,
                "tp_allreduce_seconds": c.allreduce_seconds if c else 0.0, "tp_allreduce_calls": c.allreduce_calls if c else 0}

    def close(self) -> None:
        """Stops the followers (a "stop" command, then by pid if they linger). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        told = False
        if self.failure is None and self.comm is not None and all(p.exitcode is None for p in self._procs):
            try:
                with self._lock:  # a live follower waits in the broadcast already: a frozen one must not hold us
                    self.comm.broadcast(("stop", None), min(self.comm.timeout_s, STOP_WAIT_S))
                told = True
            except Exception:  # noqa: BLE001 - they are killed below
                pass
        if told:  # give them a moment to close their groups
            for p in self._procs:
                p.join(timeout=10)
        _kill(self._procs)
        if self.comm is not None:  # with the peers gone, even a broken group closes at once
            self.comm.close()
        self._finalizer()  # once: the cores given back (in the calling thread, and threads started after)

    # -- failure ------------------------------------------------------------------------------------
    def _command(self, cmd: str, arg) -> None:
        with self._lock:
            self._send(cmd, arg)

    def _send(self, cmd: str, arg) -> None:
        self._check()
        try:
            self.comm.broadcast((cmd, arg), self.comm.timeout_s)
        except RuntimeError as e:
            raise self._fail(f"a collective failed: {e}") from e
        except BaseException as e:  # interrupted between the size and the bytes: out of step
            self._fail(f"a command was interrupted: {e!r}")
            raise
        self._last_command = time.monotonic()

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure
        gone = self._exited()
        if gone:
            raise self._fail(gone)

    def _exited(self) -> str | None:
        """The followers this process started that have exited, with their statuses; None while all run."""
        dead = [p for p in self._procs if p.exitcode is not None]
        return ", ".join(f"rank {p.name.rsplit('rank', 1)[-1]} (pid {p.pid}) exited with status {p.exitcode}" for p in dead) or None

    def _fail(self, why: str) -> ExecutorFailed:
        if self.failure is None:
            self.failure = ExecutorFailed(f"tensor-parallel executor failed: {why}")
            log.error("%s", self.failure)
        return self.failure

    def _watch_once(self, ready: list) -> bool:
        """One round of the watcher: a follower whose sentinel fired fails the runner; else a
        ping if nothing was sent for a while. False when there is nothing more to watch."""
        if self._closed or self.failure is not None:
            return False
        if ready:
            gone = [p for p in self._procs if p.sentinel in ready]
            for p in gone:  # the sentinel fires as the process ends, a moment before it is reaped
                p.join(timeout=5)
            with self._lock:
                if not self._closed and self.failure is None:
                    self._fail(", ".join(f"rank {p.name.rsplit('rank', 1)[-1]} (pid {p.pid}) exited with status {p.exitcode}"
                                         for p in gone))
            return False
        if time.monotonic() - self._last_command > PING_INTERVAL_S and self._lock.acquire(blocking=False):
            try:
                if not self._closed and self.failure is None:
                    self._send("ping", None)
            except ExecutorFailed:
                return False
            finally:
                self._lock.release()
        return True


def _watch(ref: weakref.ref) -> None:
    """The watcher thread: notices a follower death while idle and pings the followers while
    nothing else talks. It holds the runner only by a weak reference between rounds, so a runner
    its engine dropped is collected (and its followers killed by the finalizer)."""
    runner = ref()
    sentinels = [p.sentinel for p in runner._procs] if runner is not None else []
    del runner
    while True:
        if sentinels:
            ready = multiprocessing.connection.wait(sentinels, timeout=1.0)
        else:
            time.sleep(1.0)
            ready = []
        runner = ref()
        if runner is None or not runner._watch_once(ready):
            return
        del runner


# CPU runners alive in this process, and the torch thread count before the first lowered it:
# the last one to close restores that (two engines at once must not leave the second's lowered
# count behind as "the count before")
_cores = {"runners": 0, "threads_before": 0}
_cores_lock = threading.Lock()


def _host_threads() -> int:
    """The threads the ranks share: torch's intra-op count before any runner lowered it
    (OMP_NUM_THREADS, which the chart sets from the pod's CPU limit, else the CPUs this process
    may run on). Not ``os.cpu_count()``: in a container that is the node's cores, and a 2-CPU pod
    on a 64-core node ran 32 threads a rank."""
    with _cores_lock:
        return _cores["threads_before"] if _cores["runners"] else torch.get_num_threads()


def _share_cores(threads: int) -> None:
    with _cores_lock:
        if _cores["runners"] == 0:
            _cores["threads_before"] = torch.get_num_threads()
        _cores["runners"] += 1
    torch.set_num_threads(threads)


def _release(procs, shared_cores: bool) -> None:
    """Run once, by close() or as the finalizer of a runner dropped without it: its followers
    killed, and, once no CPU runner is left, the torch thread count the first one lowered for
    rank 0 restored (in the calling thread; a live engine resets its own count before each step)."""
    _kill(procs)
    if shared_cores:
        with _cores_lock:
            _cores["runners"] -= 1
            last = _cores["runners"] == 0
        if last:
            torch.set_num_threads(_cores["threads_before"])


def _kill(procs) -> None:
    """Kills (by pid) the followers still running: never leaves a spawned rank behind."""
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join(timeout=5)
