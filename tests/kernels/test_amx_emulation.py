"""The AMX kernels (``csrc/gemm_amx.c``, the AMX back-end of ``csrc/paged_extend_bf16_products.c``)
checked on CPUs without AMX: ``QWORKER_CPU_AMX_EMULATE=1`` compiles them on software tiles
(``csrc/amx_emulate.h``), which compute TDPBF16PS as the SDM specifies and abort wherever the
hardware would fault (no configuration, a tile shape an instruction does not take). Without it,
AMX code changed on a machine without AMX would first run on a customer's Sapphire Rapids.

First the emulation itself (a tiny C program: its products against Python's, its faults), then the
AMX kernels' own tests re-run on it, each in a subprocess: the build is chosen once per process,
and an emulated fault aborts the process."""

from __future__ import annotations

import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "kernels" / "csrc"
X86 = os.uname().machine in ("x86_64", "amd64")


def _cpu_flags() -> set[str]:
    try:
        line = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


needs_cc = pytest.mark.skipif(not (X86 and shutil.which(os.environ.get("CC", "cc"))), reason="needs an x86 C compiler")


def _run_program(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """Compile ``body`` (the inside of main) against the emulation and run it."""
    src = tmp_path / "prog.c"
    src.write_text(
        '#include <stdio.h>\n#include <stdint.h>\n#include <string.h>\n#define QW_AMX_EMULATE\n#include "amx_tiles.h"\n'
        f"int main(void) {{\n{body}\nreturn 0;\n}}\n")
    exe = tmp_path / "prog"
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-std=gnu11", f"-I{CSRC}", str(src), "-o", str(exe)], check=True,
                   capture_output=True, timeout=120)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)


def _bf16(x: float) -> int:
    """fp32 -> bf16 bits, round to nearest even (finite inputs)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def _f32(bits16: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits16 << 16))[0]


def _f32_round(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


@needs_cc
def test_emulated_tile_product_is_the_sdms(tmp_path):
    """C += A . B on 16 x 32 bf16 A and 16 k pairs x 16 columns B, with 4 rows and 24 bytes of
    columns configured for C (a partial tile), against the SDM's order of fp32 additions; a
    denormal input counts as zero and the rest of a loaded tile is zero."""
    import random

    rng = random.Random(5)
    rows, ncols, kpairs = 4, 6, 16
    a = [[_bf16(rng.uniform(-2, 2)) for _ in range(32)] for _ in range(rows)]
    b = [[[_bf16(rng.uniform(-2, 2)) for _ in range(2)] for _ in range(ncols)] for _ in range(kpairs)]
    a[1][3] = 0x0001  # a denormal: read as zero
    c0 = [[_f32_round(rng.uniform(-1, 1)) for _ in range(ncols)] for _ in range(rows)]
    expect = [row[:] for row in c0]
    for m in range(rows):
        for k in range(kpairs):
            for n in range(ncols):
                for j in range(2):
                    av = 0.0 if (a[m][2 * k + j] & 0x7F80) == 0 else _f32(a[m][2 * k + j])
                    expect[m][n] = _f32_round(expect[m][n] + av * _f32(b[k][n][j]))
    cfg = bytearray(64)
    cfg[0] = 1
    for t, (cb, r) in enumerate([(4 * ncols, rows), (64, rows), (4 * ncols, kpairs)]):
        cfg[16 + 2 * t:18 + 2 * t] = cb.to_bytes(2, "little")
        cfg[48 + t] = r
    c_init = ",".join(f"{v!r}f" for row in c0 for v in row)
    a_init = ",".join(str(v) for row in a for v in row)
    b_init = ",".join(str(v) for k in b for col in k for v in col)
    body = f"""
    static const uint8_t cfg[64] = {{{",".join(map(str, cfg))}}};
    float c[{rows}][{ncols}] = {{{c_init}}};
    uint16_t a[{rows}][32] = {{{a_init}}};
    uint16_t b[{kpairs}][{ncols}][2] = {{{b_init}}};
    _tile_loadconfig(cfg);
    _tile_loadd(0, c, sizeof c[0]);
    _tile_loadd(1, a, sizeof a[0]);
    _tile_loadd(2, b, sizeof b[0]);
    _tile_dpbf16ps(0, 1, 2);
    float out[{rows}][{ncols}];
    _tile_stored(0, out, sizeof out[0]);
    _tile_release();
    for (int m = 0; m < {rows}; m++) for (int n = 0; n < {ncols}; n++) printf("%a\\n", out[m][n]);
    """
    r = _run_program(tmp_path, body)
    assert r.returncode == 0, r.stderr
    got = [float.fromhex(x) for x in r.stdout.split()]
    assert got == [v for row in expect for v in row]


@needs_cc
@pytest.mark.parametrize("case, message", [
    ("_tile_zero(0);", "without a loaded configuration"),
    ("_tile_loadconfig(cfg); _tile_release(); _tile_zero(0);", "without a loaded configuration"),
    ("_tile_loadconfig(cfg); _tile_zero(5);", "tile not configured"),
    ("_tile_loadconfig(cfg); _tile_dpbf16ps(0, 1, 1);", "three distinct tiles"),
    ("_tile_loadconfig(cfg); _tile_dpbf16ps(0, 2, 1);", "shapes do not fit"),  # A 16 x 64 B, B 4 rows
    ("uint8_t bad[64]; memcpy(bad, cfg, 64); bad[5] = 1; _tile_loadconfig(bad);", "reserved configuration bytes"),
    ("uint8_t bad[64]; memcpy(bad, cfg, 64); bad[57] = 4; _tile_loadconfig(bad);", "invalid tile shape"),  # tile 9
])
def test_emulation_faults_where_the_hardware_would(tmp_path, case, message):
    """Tiles 0-2 configured (16 x 64, 4 x 64, 16 x 64), 3-7 not: each misuse aborts saying why."""
    body = ("static const uint8_t cfg[64] = {1, [16] = 64, [18] = 64, [20] = 64, [48] = 16, [49] = 4, [50] = 16};\n"
            + case + '\nputs("no fault");')
    r = _run_program(tmp_path, body)
    assert r.returncode == -signal.SIGABRT and "no fault" not in r.stdout, (r.returncode, r.stdout)
    assert message in r.stderr


def _emulated_env() -> dict[str, str]:
    env = dict(os.environ, QWORKER_CPU_AMX_EMULATE="1")
    env.pop("QWORKER_CPU_ISA", None)
    env.pop("QWORKER_CPU_AMX", None)
    return env


def _emulation_applies() -> str | None:
    """Why the kernels cannot run on emulated tiles here, or None."""
    if not X86 or not shutil.which(os.environ.get("CC", "cc")):
        return "needs an x86 C compiler"
    if not {"avx512f", "avx512bw", "avx512_bf16"} <= _cpu_flags():
        return "the AMX kernels' other half needs AVX-512 with AVX512_BF16"
    if {"amx_tile", "amx_bf16"} <= _cpu_flags():
        return "this CPU has AMX: the AMX kernels' own tests run on its tiles"
    return None


needs_emulation = pytest.mark.skipif(_emulation_applies() is not None, reason=str(_emulation_applies()))


@needs_emulation
def test_emulated_build_runs_the_amx_kernels():
    """With the flag the engine's bf16 GEMM and prefill attention pick AMX (the emulated tiles);
    without it, the same CPU picks the dot-product kernels."""
    probe = ("import kernels.gemm_cpu as g, kernels.cpu as c; "
             "print(g.amx_kernel(), c.extend_bf16_products_kernel(64), c.decode_bf16_products_kernel(64, 3, 16))")
    on = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=_emulated_env(), capture_output=True, text=True, timeout=300)
    off = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in _emulated_env().items() if k != "QWORKER_CPU_AMX_EMULATE"})
    assert on.stdout.split() == ["amx", "amx", "amx"], on.stderr[-2000:]
    assert off.stdout.split() == ["avx512_bf16", "avx512_bf16", "avx512_bf16"], off.stderr[-2000:]


@needs_emulation
def test_amx_kernel_tests_pass_on_emulated_tiles():
    """The AMX GEMM's, extend kernel's and decode kernel's own tests (against float64 oracles,
    across tile combinations, threads, batches, windows and sinks) and the bf16 model's logits
    against fp32, on AMX."""
    tests = ["tests/kernels/test_gemm_cpu_amx.py", "tests/kernels/test_gemm_cpu_amx_attack.py", "tests/kernels/test_gemm_amx_epilogues.py",
             "tests/kernels/test_kernel_cpu_extend_bf16_products.py", "tests/kernels/test_kernel_cpu_decode_bf16_products.py",
             "tests/kernels/test_kernel_sinks.py",
             "tests/kernels/test_cpu_bf16.py::test_bf16_logits_follow_fp32"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests],
                       cwd=ROOT, env=_emulated_env(), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout
