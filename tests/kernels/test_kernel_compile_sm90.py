"""Compile the kernels for Hopper (sm_90) on a machine without a GPU.

The interpreter runs the kernels' Python, not the compiler: type errors in
loop-carried values, dot shape limits or shared-memory overflow only show when
compiling. Triton's wheel carries the NVIDIA backend and ptxas, so the CPU CI
compiles to a cubin (in a subprocess: see aot_sm90.py) and checks the code is
the fast kind: 16-byte async copies for K/V rather than 2-byte scalar loads,
and Hopper's wgmma for prefill. Skipped on CUDA machines, where the other
tests compile and run natively.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="native CUDA tests compile the kernels")

SMEM_LIMIT = 227 * 1024  # per block on H100/H200


def _aot(full: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("aot_sm90.py")
    res = subprocess.run([sys.executable, str(script)] + (["--full"] if full else []),
                         env=env, capture_output=True, text=True, timeout=240)
    if res.returncode != 0 and ("ImportError" in res.stderr or "ModuleNotFoundError" in res.stderr):
        pytest.skip(f"triton's AOT compile API is unavailable here: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_kernels_compile_for_sm90_with_fast_instructions():
    rep = _aot(full=os.environ.get("KERNELS_FULL_AOT") == "1")
    for name, r in rep.items():
        assert r["shared"] <= SMEM_LIMIT, f"{name}: {r['shared']} B of shared memory"
        if name.startswith(("decode_split", "decode_direct", "prefill")):
            # K/V tiles arrive by 16-byte cp.async, pipelined, not by scalar loads.
            assert "cp.async.cg.shared.global" in r["ops"] and "ld.global.b16" not in r["ops"], (name, r)
        if name.startswith("prefill") and not name.endswith("fp32"):
            assert "wgmma.mma_async" in r["ops"], (name, r)
        if name.startswith("moe") and not name.endswith("fp32"):
            # expert weights and gathered token rows by 16-byte cp.async; tensor cores (wgmma
            # from 64-row tiles, mma.sync for the 16-row decode tiles)
            assert "cp.async.cg.shared.global" in r["ops"] and "ld.global.b16" not in r["ops"], (name, r)
            assert ("wgmma.mma_async" if "_m64_" in name else "mma.sync") in r["ops"], (name, r)
        if name.startswith(("rotary", "silu_and_mul")):
            # whole channel runs per load (strides and widths divisible by 16), not 2-byte scalar loads
            assert "ld.global.b16" not in r["ops"], (name, r)
        if name.startswith("lora") and not name.endswith("fp32"):
            # no 2-byte scalar loads of x, A, B or y (widths divisible by 16, as models have them);
            # shrink streams x and A by cp.async into tensor cores
            assert "ld.global.b16" not in r["ops"], (name, r)
            if name.startswith("lora_shrink"):
                assert "cp.async.cg.shared.global" in r["ops"], (name, r)
                assert ("wgmma.mma_async" if "_m64_" in name else "mma.sync") in r["ops"], (name, r)
