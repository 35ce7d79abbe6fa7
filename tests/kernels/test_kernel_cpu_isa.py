"""Which vector ISA build the CPU kernels run: chosen from the CPU flags at start-up, forced by
QWORKER_CPU_ISA (refused where the CPU lacks it), switchable for tests and benchmarks; and the
decode kernel's window/softcap under every build this CPU runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cpu_isa import isa  # noqa: F401  (fixture)
from kernel_testlib import assert_close, generator, make_paged_batch, oracle_attention, poison_before_window, poisoned_like

import kernels
from kernels import cpu as kcpu

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")
ROOT = Path(__file__).resolve().parents[2]


def _isa_in_subprocess(env_isa: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "QWORKER_CPU_ISA"}
    if env_isa is not None:
        env["QWORKER_CPU_ISA"] = env_isa
    code = "import kernels.cpu as c; print(c.cpu_isa(), c.cpu_kernels_available())"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_default_is_the_best_available():
    have = kcpu.available_isas()
    assert have and have[-1] == "generic" and set(have) <= set(kcpu.ISAS)
    flags = set(kcpu._cpu_features().split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"} <= flags:
        assert have[0] == "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        assert have[0] == "avx2"
    r = _isa_in_subprocess(None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [have[0], "True"]


@pytest.mark.parametrize("name", kcpu.ISAS)
def test_env_forces_an_available_isa(name):
    if name not in kcpu.available_isas():
        pytest.skip(f"this CPU lacks {name}")
    r = _isa_in_subprocess(name)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [name, "True"]


def test_env_refuses_unknown_or_missing_isas():
    r = _isa_in_subprocess("sse9")
    assert r.returncode != 0 and "QWORKER_CPU_ISA must be one of" in r.stderr
    missing = [i for i in kcpu.ISAS if i not in kcpu.available_isas()]
    if missing:
        r = _isa_in_subprocess(missing[0])
        assert r.returncode != 0 and "this CPU lacks it" in r.stderr
    with pytest.raises(ValueError):
        with kcpu.using_isa("sse9"):
            pass


def test_builds_differ_by_isa():
    """Each available ISA has its own library (its own flags), and using_isa switches between them."""
    libs = {}
    for name in kcpu.available_isas():
        with kcpu.using_isa(name):
            assert kcpu.cpu_isa() == name
            libs[name] = kcpu._library()
    assert len({id(lib) for lib in libs.values()}) == len(libs)
    assert kcpu.cpu_isa() == kcpu.available_isas()[0] or os.environ.get("QWORKER_CPU_ISA")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("w,cap", [(5, None), (37, 3.0), (None, 3.0)])
def test_decode_window_softcap_under_each_isa(seed, isa, w, cap, cache_dtype):
    gen = generator(seed)
    lens = [1, 9, 16, 19, 53, 80]
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=16, num_kv_heads=2, group=4, head_dim=64,
                             dtype=torch.float32, device="cpu")
    batch.q.mul_(2.0)
    batch = type(batch)(**{**batch.__dict__, "k_cache": batch.k_cache.to(cache_dtype), "v_cache": batch.v_cache.to(cache_dtype)})
    want = oracle_attention(batch, w, cap).float()
    if w is not None:
        batch, _ = poison_before_window(batch, w)
    out = poisoned_like(batch.q)
    kernels.paged_decode_attention_cpu(*batch.decode_args(), out=out, sliding_window=w, softcap=cap)
    assert_close(out, want, torch.float32, f"cpu decode {isa} W={w} cap={cap} {cache_dtype}")
