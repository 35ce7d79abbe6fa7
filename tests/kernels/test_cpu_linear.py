"""The model's CPU GEMM paths (qworker.model.linear): oneDNN with the weight packed once and
``x @ w`` give F.linear's result for every row count, with and without bias; the start-up choice
honours QWORKER_CPU_LINEAR and falls back where oneDNN is missing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qworker.model import linear
from qworker.model.linear import Linear

HAS_ONEDNN = linear.onednn_supported(torch.float32)[0]
HAS_PANELS = linear.panels_supported(torch.float32)[0]


@pytest.mark.parametrize("backend", ["matmul", "transposed", pytest.param("onednn", marks=pytest.mark.skipif(not HAS_ONEDNN, reason="no oneDNN")),
                                     pytest.param("panels", marks=pytest.mark.skipif(not HAS_PANELS, reason="no C kernels"))])
@pytest.mark.parametrize("rows", [1, 7, 16, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(seed, backend, rows, bias):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    lin = Linear(w, b, backend)
    with torch.inference_mode():
        y = lin(x)
    assert y.shape == (rows, 96) and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.dense_out_in(), w, rtol=0, atol=0)
    assert (lin.in_features, lin.out_features) == (40, 96)


def test_forced_backend(monkeypatch):
    sample = [torch.randn(32, 16)]
    monkeypatch.setenv("QWORKER_CPU_LINEAR", "matmul")
    assert linear.cpu_linear_backend(torch.float32, sample) == "matmul"
    monkeypatch.setenv("QWORKER_CPU_LINEAR", "bogus")
    with pytest.raises(ValueError, match="QWORKER_CPU_LINEAR"):
        linear.cpu_linear_backend(torch.float32, sample)
    monkeypatch.setenv("QWORKER_CPU_LINEAR", "onednn")
    if HAS_ONEDNN:
        assert linear.cpu_linear_backend(torch.float32, sample) == "onednn"
    # float16 is not a oneDNN linear dtype here: forcing it is an error, auto falls back
    with pytest.raises(RuntimeError, match="QWORKER_CPU_LINEAR=onednn, but that path is unavailable"):
        linear.cpu_linear_backend(torch.float16, sample)
    # the panels GEMM takes fp32 and bf16 weights, nothing else
    monkeypatch.setenv("QWORKER_CPU_LINEAR", "panels")
    if HAS_PANELS:
        assert linear.cpu_linear_backend(torch.float32, sample) == "panels"
        assert linear.cpu_linear_backend(torch.bfloat16, sample) == "panels"
    with pytest.raises(RuntimeError, match="float32 or bfloat16 weights, not torch.float16"):
        linear.cpu_linear_backend(torch.float16, sample)
    with pytest.raises(ValueError, match="float32 or bfloat16 weights, not torch.float16"):
        Linear(torch.randn(8, 4, dtype=torch.float16), None, "panels")
    monkeypatch.setenv("QWORKER_CPU_LINEAR", "auto")
    assert linear.cpu_linear_backend(torch.float16, sample) == "matmul"


def test_auto_choice_is_measured_once_where_panels_does_not_run(monkeypatch):
    if not HAS_ONEDNN:
        pytest.skip("no oneDNN")
    monkeypatch.delenv("QWORKER_CPU_LINEAR", raising=False)
    monkeypatch.setattr(linear, "_choices", {})
    monkeypatch.setattr(linear, "panels_supported", lambda dtype: (False, "no C kernels (test)"))
    calls = []

    def fake(dtype, sample, backends, **kw):
        calls.append((dtype, backends))
        return {"onednn": 3.0, "matmul": 1.0}  # oneDNN clearly slower: the fallback wins

    monkeypatch.setattr(linear, "measure_backends", fake)
    sample = [torch.randn(32, 16)]
    assert linear.cpu_linear_backend(torch.float32, sample) == "matmul"
    assert linear.cpu_linear_backend(torch.float32, sample) == "matmul"
    assert calls == [(torch.float32, ("onednn", "matmul"))]


@pytest.mark.skipif(not HAS_PANELS, reason="no C kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_takes_panels_however_the_others_time(monkeypatch, dtype):
    """Panels' fixed summation order is what keeps a row's result independent of its step's rows
    (speculation's exactness, batch invariance): no timing may trade it away, nor flip it from one
    start-up to the next."""
    if dtype == torch.bfloat16 and not linear.panels_supported(dtype)[0]:
        pytest.skip(linear.panels_supported(dtype)[1])
    monkeypatch.delenv("QWORKER_CPU_LINEAR", raising=False)
    monkeypatch.setattr(linear, "_choices", {})
    monkeypatch.setattr(linear, "measure_backends",
                        lambda dtype, sample, backends, **kw: {b: (9.0 if b == "panels" else 1.0) for b in backends})
    assert linear.cpu_linear_backend(dtype, [torch.randn(32, 16)]) == "panels"


def test_measure_backends_times_both():
    if not HAS_ONEDNN:
        pytest.skip("no oneDNN")
    t = linear.measure_backends(torch.float32, [torch.randn(64, 32), torch.randn(32, 64)], rows=(4,), rounds=1)
    assert set(t) == {"onednn", "matmul"} and all(v > 0 for v in t.values())


def test_measure_backends_leaves_the_thread_count_alone():
    """The start-up probe times one thread; torch's thread count is what it was afterwards."""
    before = torch.get_num_threads()
    t = linear.measure_backends(torch.float32, [torch.randn(48, 40)], rows=(3,), rounds=1)
    assert set(t) == {"onednn", "matmul"} and all(v >= 0 for v in t.values())
    assert torch.get_num_threads() == before


def test_preference_order_with_hysteresis():
    """The first path in BACKENDS order within 30% of the fastest is taken: a near-tie keeps the
    preferred path (the choice, and its float rounding, must not flip with noise), a clear loss
    does not."""
    assert linear._prefer({"panels": 1.25, "onednn": 1.0, "matmul": 2.0}) == "panels"
    assert linear._prefer({"panels": 1.35, "onednn": 1.0, "matmul": 2.0}) == "onednn"
    assert linear._prefer({"panels": 1.4, "onednn": 1.35, "matmul": 1.0}) == "matmul"
    assert linear._prefer({"onednn": 1.25, "matmul": 1.0}) == "onednn"


@pytest.mark.skipif(not HAS_PANELS, reason="no C kernels")
def test_measure_backends_times_panels_too():
    t = linear.measure_backends(torch.float32, [torch.randn(64, 32)], rows=(4,), rounds=1, backends=("panels", "matmul"))
    assert set(t) == {"panels", "matmul"} and all(v >= 0 for v in t.values())


@pytest.mark.skipif(not HAS_PANELS, reason="no C kernels")
def test_panels_refused_when_its_start_up_check_fails(monkeypatch):
    """A kernel that computes wrong results on this CPU is not used: the start-up check refuses it
    and auto falls back to another path."""
    from kernels import gemm_cpu

    real = gemm_cpu.gemm
    monkeypatch.setattr(gemm_cpu, "gemm", lambda x, *a, **k: real(x, *a, **k) + (1.0 if x.shape[0] == 13 else 0.0))
    ok, why = linear.panels_supported(torch.float32)
    assert not ok and "13 rows" in why
    monkeypatch.delenv("QWORKER_CPU_LINEAR", raising=False)
    monkeypatch.setattr(linear, "_choices", {})
    assert linear.cpu_linear_backend(torch.float32, [torch.randn(32, 16)]) in ("onednn", "matmul")


@pytest.mark.skipif(not HAS_PANELS, reason="the CPU C kernels are unavailable here")
@pytest.mark.parametrize("rows", [1, 3, 7, 40])
def test_bf16_panels_linear_rounds_like_the_bf16_mode(rows):
    """The CPU bf16 mode's contract on the panels path: bf16 x in (rounded from fp32 activations),
    fp32 sums, the output rounded to bf16 and handed back in the activation dtype."""
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(70, 37, generator=gen).to(torch.bfloat16), torch.randn(70, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 37, generator=gen)
    lin = Linear(w, b, "panels", act_dtype=torch.float32)
    y = lin(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 70)
    want = (x.to(torch.bfloat16).float() @ w.float().t() + b.float()).to(torch.bfloat16).float()
    torch.testing.assert_close(y, want, rtol=8e-3, atol=8e-3)  # 1 bf16 ulp: sums in another order
    low = lin.lowp(x)
    assert low.dtype == torch.bfloat16 and torch.equal(low.float(), y)
    torch.testing.assert_close(lin.dense_out_in(), w, rtol=0, atol=0)
