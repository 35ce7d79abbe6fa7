"""The CPU a benchmark ran on, for its report: model name, the vector/matrix flags that decide
which kernels run (AVX2, AVX-512, AVX512_BF16, AMX...), the C kernels' ISA build and the oneDNN
ISA cap if one is set. Figures from different CPUs are not comparable; the report says which."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def _cpuinfo_field(name: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The /proc/cpuinfo flags that select kernels: avx*, amx*, fma, f16c (empty off Linux x86)."""
    return sorted(w for w in _cpuinfo_field("flags").split() if w.startswith(("avx", "amx", "fma", "f16c")))


def summary() -> dict:
    from kernels import cpu as kcpu

    return {"model": cpu_model(), "flags": cpu_flags(), "kernel_isa": kcpu.cpu_isa(),
            "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "default"), "cores": os.cpu_count()}


def line(info: dict | None = None) -> str:
    """One Markdown line for a report."""
    i = info or summary()
    return (f"CPU: {i['model']}, {i['cores']} logical CPUs; flags {' '.join(i['flags']) or '(none listed)'}; "
            f"C kernels {i['kernel_isa']} build; oneDNN ISA {i['onednn_max_cpu_isa']}")
