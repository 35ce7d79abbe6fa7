"""The process groups: rendezvous, the model's all-reduce, the leader's command broadcast.

Every rank meets at a TCP store on ``MASTER_ADDR:MASTER_PORT`` (torchrun's rendezvous; rank 0
hosts it and waits there for the others). Over it, two groups of the same ranks:

* the model group: the all-reduce after each row-parallel projection. On CPU a private gloo
  group; on CUDA NCCL through torch.distributed's default group (so one tensor-parallel engine
  per process on CUDA). Its timeout bounds a collective with a dead or hung rank.
* the control group (always a private gloo group, on the host): the leader's broadcast of each
  step's command, a pickled :class:`~qworker.model.batch.Batch` (its size, then its bytes). A
  pickled object over gloo, not shared memory: the same code serves ranks on one host and across
  nodes. A batch carries every sequence's whole block table, so its size grows with batch x
  context: measured (one core, this module's pickle): 8 decodes of 256 tokens 1 KB, 0.02 ms
  to pickle + 0.01 ms to unpickle; 64 of 4k tokens 74 KB, 0.3 + 0.4 ms; 256 of 8k tokens
  0.6 MB, 2 + 4 ms per step (sending block-table deltas would remove it). On CUDA it stays
  off the device stream (NCCL would need a device copy).

Private groups (not torch.distributed's global default) let several CPU engines live in one
process, one after another or at once, each with its own store and groups.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import pickle
import socket
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# seconds; a collective (all-reduce, command broadcast) that takes longer means a rank is gone
DEFAULT_TIMEOUT_S = 120.0
# seconds a rank waits for the others to start, join and load the model
DEFAULT_START_TIMEOUT_S = 900.0
MAX_TIMEOUT_S = 24 * 3600.0  # a collective allowed to hang longer than a day is a typo
HEARTBEAT_S = 1.0  # a follower's beat in the store; rank 0 gives up on one silent for max(timeout, 10 beats)


def timeout_s() -> float:
    """``QWORKER_TP_TIMEOUT_S`` (a finite number of seconds > 0), else the default."""
    raw = os.environ.get("QWORKER_TP_TIMEOUT_S", "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise ValueError(f"QWORKER_TP_TIMEOUT_S must be a number of seconds in (0, {MAX_TIMEOUT_S:.0f}], got {raw!r}")
    return value


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Comm:
    """This process's membership of one tensor-parallel group; counts its all-reduce time."""

    def __init__(self, rank: int, world: int, addr: str, port: int, device: torch.device, collective_timeout_s: float | None = None,
                 exited: Callable[[], str | None] | None = None):
        """``exited`` (rank 0): which ranks it started have exited (None while all run), which
        ends every wait for the others at once instead of at the start timeout."""
        self.rank, self.world, self.device = rank, world, device
        self.exited = exited
        self.timeout_s = collective_timeout_s or timeout_s()
        self.start_timeout_s = max(DEFAULT_START_TIMEOUT_S, self.timeout_s)
        start = datetime.timedelta(seconds=self.start_timeout_s)
        short = datetime.timedelta(seconds=self.timeout_s)
        # the rendezvous waits for ranks that start late (pods of a multi-node group come up one by one)
        self.store = dist.TCPStore(addr, port, world, rank == 0, timeout=start, wait_for_workers=False)
        self._beating = threading.Event()
        if rank == 0:
            self._wait_keys([f"joined/{r}" for r in range(1, world)], "joining the group")
        else:
            self.store.set(f"joined/{rank}", b"1")
            self._beating.set()
            threading.Thread(target=self._beat, name=f"qworker-tp-beat{rank}", daemon=True).start()
        self._default = device.type == "cuda"
        if self._default:
            if device.index is not None:  # "cuda" alone: the current device (set_device wants an index)
                torch.cuda.set_device(device)
            dist.init_process_group("nccl", store=dist.PrefixStore("default", self.store), rank=rank, world_size=world, timeout=start)
            self._model_group = dist.new_group(backend="nccl", timeout=short)
            self._model = None
        else:
            self._model = dist.ProcessGroupGloo(dist.PrefixStore("model", self.store), rank, world, short)
        # the control group waits out model loads (the first command comes after them); while
        # idle the leader pings, so a follower never waits this long on a live leader
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control", self.store), rank, world, start)
        self._gathers = 0
        self.broken = False  # an all-reduce raised
        self.last_reduce: tuple[int, torch.dtype] | None = None  # (width, dtype) of the last one
        self.allreduce_seconds = 0.0
        self.allreduce_calls = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums ``t`` over the ranks, in place; every rank gets the same sum."""
        start = time.perf_counter()
        try:
            if self._model is not None:
                self._model.allreduce([t]).wait()
            else:  # NCCL: enqueued on the stream; this counts launch time, not the kernel
                dist.all_reduce(t, group=self._model_group)
        except BaseException:
            self.broken = True  # the group itself failed: no step can be finished over it
            raise
        self.last_reduce = (t.shape[-1], t.dtype)
        self.allreduce_seconds += time.perf_counter() - start
        self.allreduce_calls += 1
        return t

    def broadcast(self, obj=None, wait_s: float | None = None):
        """Rank 0 sends ``obj`` (pickled); every rank returns it. ``wait_s``: how long this call
        may wait for the others (default: the control group's start timeout). The root's send
        waits for every receiver to post its receive, so a frozen rank blocks the sender: the
        leader passes the short collective timeout for every command after start-up."""
        opts = dist.BroadcastOptions()
        if wait_s is not None:
            opts.timeout = datetime.timedelta(seconds=wait_s)
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(data)], dtype=torch.long)
        else:
            size = torch.zeros(1, dtype=torch.long)
        self.control.broadcast([size], opts).wait()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else torch.empty(int(size), dtype=torch.uint8)
        self.control.broadcast([buf], opts).wait()
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def gather(self, obj, wait_s: float | None = None) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere), through the store; rank 0 waits for
        each up to ``wait_s`` (default: the start timeout), or until it sees a spawned rank gone."""
        self._gathers += 1
        key = f"gather/{self._gathers}/"
        if self.rank != 0:
            self.store.set(key + str(self.rank), pickle.dumps(obj))
            return None
        keys = [key + str(r) for r in range(1, self.world)]
        self._wait_keys(keys, "answering", wait_s)
        return [obj] + [pickle.loads(self.store.get(k)) for k in keys]

    def _beat(self) -> None:
        """A follower's heartbeat in the store while its group is open: rank 0 cannot watch the
        process of a rank on another node, so a rank that joined and then went silent (killed
        while loading the model) is seen by its beat stopping."""
        while self._beating.is_set():
            try:
                self.store.add(f"beat/{self.rank}", 1)
            except Exception:  # noqa: BLE001 - the store (rank 0) is gone, or the group closed
                return
            time.sleep(HEARTBEAT_S)

    def _wait_keys(self, keys: list[str], what: str, wait_s: float | None = None) -> None:
        """Waits for ``keys`` in the store; ends early when a spawned rank exits (``exited``) or a
        rank that has beaten stops beating for ``silent_s`` (ranks on other nodes)."""
        wait_s = self.start_timeout_s if wait_s is None else wait_s
        now = time.monotonic()
        deadline = now + wait_s
        silent_s = max(self.timeout_s, 10 * HEARTBEAT_S)
        beats = {r: (0, now) for r in range(1, self.world)}  # rank -> (last beat seen, when it changed)
        while not self.store.check(keys):
            now = time.monotonic()
            gone = self.exited() if self.exited is not None else None
            if gone:
                raise RuntimeError(f"{gone} before {what}")
            for r, (seen, since) in beats.items():
                beat = self.store.add(f"beat/{r}", 0)
                if beat != seen:
                    beats[r] = (beat, now)
                elif seen and now - since > silent_s:
                    raise RuntimeError(f"rank {r} went silent (no heartbeat for {now - since:.0f} s) before {what}")
            if now > deadline:
                raise RuntimeError(f"ranks did not finish {what} within {wait_s:.0f} s")
            time.sleep(0.05)

    def close(self) -> None:
        """Drops the groups (their connections close with them)."""
        self._beating.clear()
        self._model = self.control = None
        if self._default and dist.is_initialized():
            dist.destroy_process_group()
            self._default = False
        self.store = None
