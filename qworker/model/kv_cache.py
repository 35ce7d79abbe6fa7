"""The KV tensors: a device pool of blocks per layer and a CPU swap pool of the same block shape.

Layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for K and for V; one block
id names the same block in every layer. The CPU pool is pinned when the device is CUDA, so swaps
can overlap with compute.

When the device is the CPU, the pool lives on transparent huge pages where the kernel allows them
(:func:`huge_page_zeros`): decode attention reads every sequence's blocks scattered over the pool,
a few KiB each, and with 4 KiB pages nearly every block read is a TLB miss. Measured on the 2-vCPU
AVX2 EPYC (THP in ``madvise`` mode, so torch's own allocations get none): fp32 decode attention
0.84-0.95x the time in the measurements in docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor in its own private anonymous mapping, 2 MiB aligned and advised
    ``MADV_HUGEPAGE``, so that the kernel backs it with huge pages where THP is ``always`` or
    ``madvise`` (torch's own allocations get them only under ``always``). Every page is touched
    here, as ``torch.zeros`` would: a pool too large for the machine fails at start-up, not under
    load. The tensor's storage is exactly its bytes (the alignment slack is not part of it).
    Falls back to ``torch.zeros`` for tensors under 2 MiB or where ``madvise`` is unavailable (not
    Linux) or refused."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_PAGE or advice is None:
        return torch.zeros(shape, dtype=dtype)
    try:
        # private: a shared anonymous mapping is shmem, which THP's `enabled` setting does not cover
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(advice)
    except (OSError, ValueError):
        return torch.zeros(shape, dtype=dtype)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    # a view of exactly nbytes at the first 2 MiB boundary; it keeps the mapping alive (ctypes
    # holds the exporting object), and the tensor keeps the view
    view = (ctypes.c_char * nbytes).from_buffer(region, -base % HUGE_PAGE)
    raw = torch.frombuffer(view, dtype=torch.uint8)
    raw[::mmap.PAGESIZE] = 0  # commit every page now (anonymous pages read as zero already)
    return raw.view(dtype).view(shape)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        def zeros() -> torch.Tensor:
            return huge_page_zeros(shape, dtype) if device.type == "cpu" else torch.zeros(shape, device=device, dtype=dtype)

        self.layers = [(zeros(), zeros()) for _ in range(num_layers)]
        cpu_shape = (num_cpu_blocks, *shape[1:])
        pin = device.type == "cuda"
        # empty, not zeros: a swap block is only read after a swap-out wrote it, and untouched
        # pages of a large swap space then cost no resident memory
        self.cpu_layers = [
            (torch.empty(cpu_shape, dtype=dtype, pin_memory=pin), torch.empty(cpu_shape, dtype=dtype, pin_memory=pin))
            for _ in range(num_layers if num_cpu_blocks else 0)
        ]
        self.device = device

    def apply(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], copy: list[tuple[int, int]]) -> None:
        """Block moves the scheduler recorded, in its order: swap out, swap in, copy-on-write."""
        if swap_out:
            dev, cpu = self._index(swap_out)
            for (k, v), (ck, cv) in zip(self.layers, self.cpu_layers):
                ck[cpu] = k[dev.to(k.device)].to("cpu")
                cv[cpu] = v[dev.to(v.device)].to("cpu")
        if swap_in:
            cpu, dev = self._index(swap_in)
            dev = dev.to(self.device)
            for (k, v), (ck, cv) in zip(self.layers, self.cpu_layers):
                k[dev] = ck[cpu].to(self.device, non_blocking=True)
                v[dev] = cv[cpu].to(self.device, non_blocking=True)
        if copy:
            src, dst = self._index(copy)
            src, dst = src.to(self.device), dst.to(self.device)
            for k, v in self.layers:
                k[dst] = k[src]
                v[dst] = v[src]

    @staticmethod
    def _index(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.tensor(pairs, dtype=torch.long)
        return t[:, 0], t[:, 1]
