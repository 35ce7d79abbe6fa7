"""Adversarial checks of the bf16-weight panels GEMM (kernels/gemm_cpu.py, csrc/gemm_bf16.c) and
of the CPU bf16 mode's ``"panels"`` Linear.

Regression: ``out=`` aliasing the input (``gemm(x, packed, out=x)`` with N == K, or views of one
buffer) or the bias. The kernel writes y tile by tile while later tiles still read x, so an
aliased x was read back half overwritten: errors of several hundred on unit-scale data, silently
(torch's ``matmul(..., out=x)`` gives the right product). The fp32 weights' kernel had the same
defect; both now copy an aliased x or bias first.

Held under attack and kept as guards: each output row is the same bits whatever the other rows,
the thread count, the blocking knobs or the K blocks (every column sums k = 0..K-1 in order, as
the C file's header says; prefix caching, preemption and batching then leave bf16 greedy outputs
unchanged), and the bf16 result is the fp32 one rounded; the bf16 Linear holds only the bf16
panels (no fp32 copy of the weight), survives deepcopy/pickle, and gives the same bits from
concurrent Python threads."""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import threading

import pytest
import torch
from cpu_isa import isa  # noqa: F401  (fixture)

from kernels import gemm_cpu
from qworker.model import linear
from qworker.model.linear import Linear

CC = os.environ.get("CC", "cc")
pytestmark = pytest.mark.skipif(shutil.which(CC) is None, reason="no C compiler on this machine")
BF, F32 = torch.bfloat16, torch.float32


def _weights(g, N, K, wdtype):
    w = torch.randn(N, K, generator=g).to(BF).to(wdtype)
    return w, gemm_cpu.pack_weight(w, "panels"), torch.randn(N, generator=g).to(BF).to(wdtype)


@pytest.mark.parametrize("wdtype", [F32, BF], ids=["w32", "w16"])
def test_out_aliasing_x_or_bias(isa, wdtype):  # noqa: F811
    g = torch.Generator().manual_seed(21)
    K = N = 80  # 5 panels: more than one tile of columns per row, even for the 1-row (4-panel) tile
    w, packed, b = _weights(g, N, K, wdtype)
    xdtypes = [F32] if wdtype == F32 else [F32, BF]
    for xdt in xdtypes:
        odt = xdt  # out=x needs out of x's dtype
        for M in (1, 2, 9, 70):
            for threads in (1, 2):
                x = torch.randn(M, K, generator=g).to(BF).to(xdt)
                want = gemm_cpu.gemm(x.clone(), packed, b, N, out_dtype=odt if wdtype == BF else None, threads=threads)
                got = gemm_cpu.gemm(x, packed, b, N, out=x, out_dtype=odt if wdtype == BF else None, threads=threads)
                assert got is x
                assert torch.equal(x, want), f"out=x, {xdt}, M={M}, threads={threads}: max err {(x.float() - want.float()).abs().max()}"

                # out a view of the same buffer, shifted half a row from x (partial overlap)
                buf = torch.randn(M, 2 * K, generator=g).to(BF).to(xdt)
                xv, outv = buf[:, :K], buf[:, K // 2:K // 2 + N]
                want = gemm_cpu.gemm(xv.clone(), packed, b, N, out_dtype=odt if wdtype == BF else None, threads=threads)
                gemm_cpu.gemm(xv, packed, b, N, out=outv, out_dtype=odt if wdtype == BF else None, threads=threads)
                assert torch.equal(outv, want), f"overlapping views, {xdt}, M={M}, threads={threads}"

        # the bias is out's first row
        M = 9
        x = torch.randn(M, K, generator=g).to(BF).to(xdt)
        out = torch.empty(M, N, dtype=odt if wdtype == BF else F32)
        out[0] = b.to(out.dtype)
        bias = out[0]
        want = gemm_cpu.gemm(x, packed, bias.clone(), N, out_dtype=out.dtype if wdtype == BF else None)
        gemm_cpu.gemm(x, packed, bias, N, out=out, out_dtype=out.dtype if wdtype == BF else None)
        assert torch.equal(out, want), f"bias aliasing out, {xdt}"


def test_rows_independent_of_batch_threads_and_blocking(isa):  # noqa: F811
    """Row i of y is the same bits computed alone, in any batch, on 1-3 threads, with any x block,
    weight group or K block; the bf16 result is the fp32 accumulator rounded."""
    g = torch.Generator().manual_seed(22)
    for N, K in [(70, 33), (16, 300), (131, 64)]:
        w, packed, b = _weights(g, N, K, BF)
        x = torch.randn(23, K, generator=g).to(BF)
        alone = torch.cat([gemm_cpu.gemm(x[i:i + 1], packed, b, N, out_dtype=F32, threads=1) for i in range(23)])
        for M in (2, 3, 5, 6, 7, 13, 23):
            for threads, mc, group, kc in [(1, 0, 0, 0), (2, 0, 0, 0), (3, 7, 1, 5), (2, 13, 3, 0), (3, 0, 2, 1)]:
                y = gemm_cpu.gemm(x[:M], packed, b, N, out_dtype=F32, threads=threads, mc=mc, group=group, kc=kc)
                assert torch.equal(y, alone[:M]), (N, K, M, threads, mc, group, kc)
                yb = gemm_cpu.gemm(x[:M], packed, b, N, threads=threads, mc=mc, group=group, kc=kc)
                assert torch.equal(yb, y.to(BF)), (N, K, M, threads, mc, group, kc)


@pytest.mark.skipif(not linear.panels_supported(BF)[0], reason="the bf16 panels GEMM is unavailable")
def test_bf16_linear_holds_only_bf16_panels_and_copies_threads():
    g = torch.Generator().manual_seed(23)
    N, K = 100, 72
    w = torch.randn(N, K, generator=g).to(BF)
    b = torch.randn(N, generator=g).to(BF)
    lin = Linear(w, b, "panels", F32)
    # only the packed bf16 panels: no fp32 weight kept beside them
    assert lin.weight.dtype == BF and tuple(lin.weight.shape) == (7, K, 16)
    held = [getattr(lin, s) for s in Linear.__slots__ if isinstance(getattr(lin, s), torch.Tensor)]
    assert sum(t.untyped_storage().nbytes() for t in held) == 7 * K * 16 * 2 + N * 2
    assert torch.equal(lin.dense_out_in(), w)

    x = torch.randn(9, K, generator=g)
    y = lin(x)
    assert y.dtype == F32
    ref = (x.to(BF).double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(y, ref, rtol=2 ** -8, atol=1e-5)
    assert torch.equal(y, ref.to(BF).float()) or (y != ref.to(BF).float()).float().mean() < 0.02
    assert torch.equal(lin.lowp(x), y.to(BF))
    for clone in (copy.deepcopy(lin), pickle.loads(pickle.dumps(lin))):
        assert clone.weight.dtype == BF and torch.equal(clone(x), y)

    errors = []

    def worker():
        for _ in range(20):
            if not torch.equal(lin(x), y):
                errors.append(1)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_torch_fallback_checks_out_like_the_kernel(monkeypatch):
    """Without the C kernels gemm falls back to torch; an ``out`` the kernel path refuses (wrong
    shape, transposed [n_out, rows], wrong dtype) was silently filled in the fallback (reshaped or
    converted) for fp32 weights. Both weight dtypes now refuse it there too."""
    monkeypatch.setenv("QWORKER_CPU_KERNELS", "0")
    assert gemm_cpu.kernel_isa(F32) is None and gemm_cpu.kernel_isa(BF) is None
    g = torch.Generator().manual_seed(24)
    M, N, K = 5, 20, 8
    x = torch.randn(M, K, generator=g)
    for wdtype in (F32, BF):
        w, packed, b = _weights(g, N, K, wdtype)
        for bad in (torch.empty(N, M, dtype=wdtype), torch.empty(M * N, dtype=wdtype), torch.empty(M, N, dtype=torch.float64)):
            with pytest.raises(ValueError, match="out must be"):
                gemm_cpu.gemm(x, packed, b, N, out=bad)
        out = torch.empty(M, N, dtype=wdtype)
        assert gemm_cpu.gemm(x, packed, b, N, out=out) is out
        assert torch.equal(out, gemm_cpu.gemm(x, packed, b, N))
