"""How much memory a CPU worker may give its KV cache when ``kv_cache_memory`` is a fraction.

On CUDA a fraction is vLLM's ``gpu_memory_utilization`` (the engine measures the device). On CPU
there is no device to measure, so the fraction applies to the memory available when the worker
starts, less what the model's weights will take:

    budget = fraction x (available - size of the model's weight files)

"available" is the container's memory limit less its current usage when a cgroup sets a limit
(a Kubernetes pod), else the machine's ``MemAvailable``, whichever is smaller. The weights are
counted at their size on disk (a bf16 checkpoint run in fp32 takes twice that: leave room).
"""

from __future__ import annotations

from pathlib import Path

_CGROUP_V2 = Path("/sys/fs/cgroup")
_CGROUP_V1 = Path("/sys/fs/cgroup/memory")
_NO_LIMIT = 1 << 60  # cgroup v1 reports "no limit" as a huge number


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (v2, no limit) is not a number


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(cgroup_v2: Path = _CGROUP_V2, cgroup_v1: Path = _CGROUP_V1, meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes this process can still allocate: the smaller of the cgroup's headroom (limit less
    usage) and the machine's available memory. 0 when nothing can be read."""
    candidates = []
    for limit_file, usage_file in ((cgroup_v2 / "memory.max", cgroup_v2 / "memory.current"),
                                   (cgroup_v1 / "memory.limit_in_bytes", cgroup_v1 / "memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < _NO_LIMIT:
            candidates.append(max(limit - usage, 0))
            break
    host = _meminfo_available(meminfo)
    if host is not None:
        candidates.append(host)
    return min(candidates) if candidates else 0


def weights_bytes(model_dir: str | Path | None) -> int:
    """The size on disk of the model's ``*.safetensors`` files (0 when unknown)."""
    if not model_dir:
        return 0
    try:
        return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    except OSError:
        return 0


def cpu_kv_budget(fraction: float, model_dir: str | Path | None, available: int | None = None) -> int:
    """``fraction`` (0 < f <= 1) of the memory left for the KV cache on CPU, in bytes."""
    free = available_memory() if available is None else available
    return int(fraction * max(free - weights_bytes(model_dir), 0))
