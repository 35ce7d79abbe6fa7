"""bench/attention_cpu.py runs end to end on tiny shapes (decode paths of every available ISA and
of a git revision's kernel, whole-model prefill on the tiny random model) and writes sane JSON and
a table (the figures themselves are not checked)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def test_attention_cpu_bench_smoke(tiny_model_dir, tmp_path, capsys):
    from bench import attention_cpu
    from kernels import cpu as kcpu

    r = attention_cpu.main(["--model", str(tiny_model_dir), "--batches", "2,3", "--layers", "2", "--min-len", "5",
                            "--max-len", "40", "--rounds", "2", "--flush-mib", "1", "--bandwidth-mib", "8", "--cache-dtypes", "float32,bfloat16",
                            "--baseline-rev", "HEAD", "--reference", "--prefill", "24", "--prefill-rounds", "1",
                            "--out", str(tmp_path)])
    files = sorted(tmp_path.glob("attention_cpu-*.json"))
    assert len(files) == 1
    assert json.loads(files[0].read_text())["decode"] == json.loads(json.dumps(r["decode"]))
    assert r["commit"] and r["machine"] and r["bandwidth_gb_s"] > 0 and r["isa_chosen"] == kcpu.cpu_isa()
    paths = [f"c:{i}" for i in kcpu.available_isas()] + ["c@HEAD", "reference"]
    assert [(c["cache_dtype"], c["batch"]) for c in r["decode"]] == [("float32", 2), ("float32", 3), ("bfloat16", 2), ("bfloat16", 3)]
    for c in r["decode"]:
        assert list(c["ms"]) == paths and all(v > 0 for v in c["ms"].values())
        assert c["floor_ms"] > 0 and c["vs_floor"]["reference"] == pytest.approx(c["ms"]["reference"] / c["floor_ms"])
    assert r["decode"][2]["kv_mib"] == pytest.approx(r["decode"][0]["kv_mib"] / 2)  # bf16: half the bytes
    (p,) = r["prefill"]
    assert p["prompt_tokens"] == 24 and set(p["tokens_per_s"]) == {"extend kernel", "reference"}
    assert p["speedup"] == pytest.approx(p["tokens_per_s"]["extend kernel"] / p["tokens_per_s"]["reference"])
    assert kcpu.EXTEND_KERNEL  # switched back on
    out = capsys.readouterr().out
    assert "| KV dtype | batch |" in out and "| prompt tokens | reference | extend kernel | speedup |" in out


def test_attention_cpu_bf16_products_against_a_revision(tmp_path):
    """The bf16 mode's decode kernel (--bf16-products) timed against the same kernel built from a
    git revision: both paths run and give finite times (needs git and a C compiler)."""
    import shutil

    from bench import attention_cpu
    from kernels import cpu as kcpu

    if shutil.which("git") is None or not (ROOT / ".git").exists() or shutil.which("cc") is None:
        pytest.skip("needs git, the repository's history and a C compiler")
    isa = kcpu.available_isas()[0]
    r = attention_cpu.main(["--batches", "3", "--layers", "2", "--min-len", "17", "--max-len", "40", "--cache-dtypes", "bfloat16",
                            "--bf16-products", "--rounds", "1", "--flush-mib", "0", "--bandwidth-mib", "8", "--isas", isa,
                            "--baseline-rev", "HEAD", "--out", str(tmp_path)])
    assert r == json.loads(next(tmp_path.glob("attention_cpu-*.json")).read_text()) | {"decode": r["decode"]}
    (row,) = r["decode"]
    assert set(row["ms"]) == {f"c:{isa}", "c@HEAD"}
    assert all(math.isfinite(v) and v > 0 for v in row["ms"].values())
