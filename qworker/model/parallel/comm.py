"""The process group: rendezvous, the model's all-reduce, the leader's command broadcast.

Two groups over the same ranks:

* the model group (NCCL on CUDA, gloo on CPU): the all-reduce after each row-parallel projection.
  Its timeout bounds a collective with a dead or hung rank.
* the control group (always gloo, on the host): the leader's broadcast of each step's command, a
  pickled :class:`~qworker.model.batch.Batch` (``broadcast_object_list``: a size, then the
  bytes). A pickled object over gloo, not shared memory: the same code serves ranks on one host
  and across nodes, and a step's batch is a few KB that costs well under a millisecond to send
  next to the forward. On CUDA it stays off the device stream (NCCL would need a device copy).

Rendezvous is torchrun's: ``tcp://MASTER_ADDR:MASTER_PORT``, rank 0 hosts the store.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# seconds; a collective (all-reduce, command broadcast) that takes longer means a rank is gone
DEFAULT_TIMEOUT_S = 120.0
# seconds a rank waits for the others to load the model and join
DEFAULT_START_TIMEOUT_S = 900.0


def timeout_s() -> float:
    return float(os.environ.get("QWORKER_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Comm:
    """This process's membership of the group; counts its all-reduce time (seconds, calls)."""

    def __init__(self, rank: int, world: int, addr: str, port: int, device: torch.device, collective_timeout_s: float | None = None):
        self.rank, self.world, self.device = rank, world, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout_s = collective_timeout_s or timeout_s()
        start = datetime.timedelta(seconds=max(DEFAULT_START_TIMEOUT_S, self.timeout_s))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # the rendezvous waits for ranks that start late (pods of a multi-node group come up one
        # by one); the model group's collectives get the short timeout
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world, timeout=start)
        self.model = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=self.timeout_s))
        # the control group waits out model loads (the first command comes after them); while
        # idle the leader pings, so a follower never waits this long on a live leader
        self.control = dist.new_group(backend="gloo", timeout=start)
        self.allreduce_seconds = 0.0
        self.allreduce_calls = 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        dist.all_reduce(t, group=self.model)
        # on CUDA the call returns once enqueued: this counts launch time, not the NCCL kernel
        self.allreduce_seconds += time.perf_counter() - start
        self.allreduce_calls += 1
        return t

    def broadcast(self, obj=None):
        """Rank 0 sends ``obj``; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere), over the control group."""
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
