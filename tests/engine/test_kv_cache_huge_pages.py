"""The CPU KV pool on transparent huge pages (qworker/model/kv_cache.py's huge_page_zeros)."""

from __future__ import annotations

import gc
import mmap
import re
from pathlib import Path

import pytest
import torch

from qworker.model.kv_cache import HUGE_PAGE, KVCache, huge_page_zeros


def _resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE / 2**20


def _mapping_resident_mib(address: int) -> float:
    """Resident memory of the one mapping that holds ``address`` (/proc/self/smaps): unlike the
    process's total, it does not move with what other threads allocate or free meanwhile."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_tensors_are_aligned_zero_and_writable(dtype):
    t = huge_page_zeros((600, 16, 3, 64), dtype)  # 3.5 MiB in a 16-bit dtype
    assert t.shape == (600, 16, 3, 64) and t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu"
    assert t.data_ptr() % HUGE_PAGE == 0
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()  # no alignment slack in it
    assert not t.any()
    t[7, 3] = 1.5
    assert t.sum().item() == 1.5 * 3 * 64


def test_small_tensors_take_torch_zeros():
    t = huge_page_zeros((4, 16, 2, 8), torch.float32)
    assert not t.any() and t.shape == (4, 16, 2, 8) and t.untyped_storage().nbytes() == t.numel() * 4


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="no /proc here to read resident memory from")
def test_memory_is_returned_when_the_last_view_goes():
    before = _resident_mib()
    t = huge_page_zeros((64 << 20,), torch.uint8)
    t.fill_(1)
    view = t[HUGE_PAGE: 2 * HUGE_PAGE]
    del t
    gc.collect()
    assert view.sum().item() == HUGE_PAGE  # the view keeps the mapping alive
    del view
    gc.collect()
    assert _resident_mib() < before + 32


def test_cpu_pool_uses_it_and_the_kv_moves_still_work():
    kv = KVCache(num_layers=2, num_blocks=400, num_cpu_blocks=8, block_size=16, num_kv_heads=2, head_dim=64,
                 device=torch.device("cpu"), dtype=torch.float32)
    for k, v in kv.layers:
        assert k.data_ptr() % HUGE_PAGE == 0 and v.data_ptr() % HUGE_PAGE == 0 and not k.any() and not v.any()
    k0 = kv.layers[0][0]
    k0[3].normal_()
    want = k0[3].clone()
    kv.apply(swap_out=[(3, 5)], swap_in=[], copy=[])
    k0[3].zero_()
    kv.apply(swap_out=[], swap_in=[(5, 9)], copy=[(9, 11)])
    assert torch.equal(k0[9], want) and torch.equal(k0[11], want)


@pytest.mark.skipif(not re.search(r"\[(always|madvise)\]", Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
                                  if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists() else ""),
                    reason="transparent huge pages are off (or not Linux) on this machine")
def test_the_kernel_backs_it_with_huge_pages():
    """Where THP is `always` or `madvise`, touched memory shows up as AnonHugePages (best effort:
    the kernel may lack free huge pages, so at least some of 64 MiB)."""
    def anon_huge_kib() -> int:
        m = re.search(r"AnonHugePages:\s+(\d+) kB", Path("/proc/self/smaps_rollup").read_text())
        return int(m.group(1)) if m else 0

    before = anon_huge_kib()
    t = huge_page_zeros((64 << 20,), torch.uint8)
    t.fill_(1)
    assert anon_huge_kib() - before >= 2048
    del t


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="no /proc here to read resident memory from")
def test_every_page_is_committed_at_allocation():
    """Review regression: the mapping was committed lazily, so an oversized pool would fail under
    load instead of at start-up (torch.zeros writes every page)."""
    t = huge_page_zeros((48 << 20,), torch.uint8)
    assert _mapping_resident_mib(t.data_ptr()) >= 40  # (the process's total once fell meanwhile: CI)
    del t
