"""The CPU engine's paged decode attention: a small C kernel that reads K/V pages in place.

The torch reference (:func:`kernels.reference.paged_decode_attention_ref`) must gather every
sequence's pages into a contiguous copy before one SDPA call; on a CPU that copy costs as much as
the attention itself (decode is memory-bound, and the gather reads and writes the whole context
once more). ``cpu/paged_decode.c`` walks the block table instead, as the Triton kernel does on the
GPU. It is compiled on first use with the system C compiler (``-O3 -march=native -fopenmp``, about
a second) into a per-user cache keyed by the source, the flags and this CPU's feature flags, and
loaded with ctypes (which releases the GIL during the call).

Without a compiler, with ``QWORKER_CPU_KERNELS=0``, or for inputs the kernel does not cover (any
dtype but float32, non-contiguous caches), :func:`paged_decode_attention_cpu` runs the reference:
same signature, same results up to float rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from .reference import paged_decode_attention_ref

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu") / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]


def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("QWORKER_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qworker", "kernels"
    )
    return Path(root)


@cache
def _library() -> ctypes.CDLL | None:
    """Build (once per source/flags/CPU) and load the kernel; None when that is not possible."""
    if os.environ.get("QWORKER_CPU_KERNELS", "1") == "0":
        return None
    compiler = os.environ.get("CC", "cc")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(_FLAGS).encode(), compiler.encode(), _cpu_features().encode(), platform.machine().encode()])).hexdigest()[:16]
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / f"qworker-kernels-{os.getuid()}"):
        target = directory / f"paged_decode-{key}.so"
        try:
            if not target.exists():
                directory.mkdir(parents=True, exist_ok=True)
                # build beside the target, then rename: concurrent processes never load a torn file
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
                os.close(fd)
                try:
                    subprocess.run([compiler, *_FLAGS, "-o", tmp, str(_SOURCE)], check=True, capture_output=True, timeout=300)
                    os.replace(tmp, target)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            lib = ctypes.CDLL(str(target))
            break
        except PermissionError:
            continue  # read-only cache dir: try the temp dir
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("CPU attention kernel unavailable (%s %s); using the torch reference", exc, detail.decode(errors="replace")[-500:])
            return None
    else:
        log.warning("CPU attention kernel unavailable (no writable cache dir); using the torch reference")
        return None
    fn = lib.qw_paged_decode_f32
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = ctypes.c_int
    return lib


def cpu_kernels_available() -> bool:
    return _library() is not None


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference.paged_decode_attention_ref` (``num_splits`` is
    ignored: the kernel parallelises over sequences and KV heads)."""
    lib = _library()
    if lib is None or not _covered(q, k_cache, v_cache, block_tables, seq_lens, out):
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out=out)
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    result = out if out is not None else torch.empty_like(q)
    if B == 0:
        return result
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    tables, lens = tables.contiguous() if tables.stride(1) != 1 else tables, lens.contiguous()
    rc = lib.qw_paged_decode_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), result.data_ptr(), result.stride(0), B, Hq, Hkv, D, block_size, float(scale), torch.get_num_threads(),
    )
    if rc != 0:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out=out)
    return result


def _covered(q, k_cache, v_cache, block_tables, seq_lens, out) -> bool:
    """Inputs the C kernel handles: fp32 everywhere, on CPU, dense per-row layouts."""
    tensors = [q, k_cache, v_cache] + ([out] if out is not None else [])
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return False
    if block_tables.device.type != "cpu" or seq_lens.device.type != "cpu":
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    rows_dense = [q] + ([out] if out is not None else [])
    heads_ok = q.shape[1] % k_cache.shape[2] == 0 and q.shape[2] % 8 == 0  # the kernel steps D by 8
    return heads_ok and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in rows_dense)
