"""The bounded greedy head (kernels/greedy_head.py, csrc/greedy_head.c): its token must be the
full fp32 head's argmax, bit for bit the same decision, ties (the first index) and NaN included,
under each ISA build this CPU runs. The inputs aim at the filter's edges: exact ties across and
within panels, logits a few ulps apart, rows where every column is a candidate (the full-head
fallback), non-finite and huge inputs, denormals, a vocabulary that ends mid-panel and a K that
the bf16 AMX layout does not take."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from cpu_isa import isa  # noqa: F401  (fixture)

from kernels import gemm_cpu
from kernels.cpu import argmax_rows_cpu, cpu_isa
from kernels.greedy_head import BoundedGreedyHead, bounded_head_supported

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")


def _full(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    return argmax_rows_cpu(gemm_cpu.gemm(x, packed, None, n))


def _head(w: torch.Tensor) -> tuple[BoundedGreedyHead, torch.Tensor]:
    packed = gemm_cpu.pack_weight(w)
    return BoundedGreedyHead(packed, w.shape[0]), packed


def _rows_near(w: torch.Tensor, g: torch.Tensor, n: int) -> torch.Tensor:
    """Hidden-state-like rows: pulled toward random vocabulary rows, so the top logits stand out
    as in a trained model, plus noise."""
    pick = torch.randint(0, w.shape[0], (n,), generator=g)
    return w[pick] * 8.0 + torch.randn(n, w.shape[1], generator=g)


@pytest.mark.parametrize("V,K", [(1000, 64), (4099, 96), (2051, 40), (17, 576)])
def test_the_token_is_the_full_heads_argmax(isa, V, K):
    g = torch.Generator().manual_seed(V + K)
    w = torch.randn(V, K, generator=g) * 0.5
    head, packed = _head(w)
    x = torch.cat([_rows_near(w, g, 40), torch.randn(24, K, generator=g) * 3.0, torch.randn(3, K, generator=g) * 1e-3])
    assert torch.equal(head.argmax(x), _full(x, packed, V))


def test_exact_ties_take_the_first_index_within_and_across_panels(isa):
    g = torch.Generator().manual_seed(1)
    V, K = 300, 64
    w = torch.randn(V, K, generator=g)
    # the same row at 5 (panel 0), 9 (panel 0), 40 (panel 2) and 299 (the last, partial panel)
    for j in (9, 40, 299):
        w[j] = w[5]
    head, packed = _head(w)
    x = w[5].unsqueeze(0) * 4.0 + torch.randn(8, K, generator=g) * 0.01
    got = head.argmax(x)
    assert torch.equal(got, _full(x, packed, V))
    assert (got == 5).all()  # every row here has its maximum at the tied rows


def test_logits_a_few_ulps_apart_go_to_the_exact_values(isa):
    """Pairs of rows that differ in a single weight's last bits: their logits differ by less than
    the bf16 error, so both are candidates and only the exact fp32 values decide."""
    g = torch.Generator().manual_seed(2)
    V, K = 512, 128
    w = torch.randn(V, K, generator=g)
    for a, b in ((10, 11), (100, 260), (33, 500)):
        w[b] = w[a]
        w[b, 7] = torch.nextafter(w[a, 7], torch.tensor(float("inf")))
        w[b, 90] = torch.nextafter(torch.nextafter(w[a, 90], torch.tensor(0.0)), torch.tensor(0.0))
    head, packed = _head(w)
    x = torch.cat([w[[10, 11, 100, 260, 33, 500]] * 3.0, torch.randn(6, K, generator=g) * 0.001 + w[[11, 10, 260, 100, 500, 33]]])
    assert torch.equal(head.argmax(x), _full(x, packed, V))


def test_rows_the_filter_cannot_settle_take_the_full_head(isa):
    g = torch.Generator().manual_seed(3)
    V, K = 700, 64
    w = torch.randn(V, K, generator=g)
    head, packed = _head(w)
    nan_row = torch.randn(K, generator=g)
    nan_row[3] = float("nan")
    inf_row = torch.randn(K, generator=g)
    inf_row[5] = float("inf")
    x = torch.stack([
        torch.zeros(K),  # every logit 0: every column a candidate
        torch.full((K,), 1e-41),  # denormal inputs
        nan_row,
        inf_row,
        torch.randn(K, generator=g) * 1e37,  # products past fp32's range
        torch.randn(K, generator=g),
    ])
    assert torch.equal(head.argmax(x), _full(x, packed, V))


def test_a_padded_vocabulary_never_yields_a_padding_column(isa):
    """V = 33 ends one column into a panel: the 15 zero columns after it are never a token, even
    when every real logit is negative (a zero padding column would beat them all)."""
    g = torch.Generator().manual_seed(4)
    V, K = 33, 32
    w = -torch.rand(V, K, generator=g) - 0.5
    head, packed = _head(w)
    x = torch.rand(16, K, generator=g) + 0.1  # positive: every logit negative
    got = head.argmax(x)
    assert torch.equal(got, _full(x, packed, V)) and (got < V).all()


def test_bad_inputs_are_refused():
    head, _ = _head(torch.randn(50, 32))
    with pytest.raises(ValueError, match="fp32"):
        head.argmax(torch.randn(2, 31))
    with pytest.raises(ValueError, match="fp32"):
        head.argmax(torch.randn(2, 32, dtype=torch.float64))
    with pytest.raises(ValueError, match="panels"):
        BoundedGreedyHead(gemm_cpu.pack_weight(torch.randn(50, 32).bfloat16()), 50)
    assert head.argmax(torch.empty(0, 32)).shape == (0,)


def test_it_is_offered_exactly_where_bf16_dot_products_exist():
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    ok, why = bounded_head_supported()
    has_bf16_dot = ("avx512_bf16" in flags or "amx_bf16" in flags) and cpu_isa() == "avx512"  # the active build's
    if os.environ.get("QWORKER_CPU_AMX") == "0":
        pytest.skip("QWORKER_CPU_AMX=0 turns the bf16 dot-product layout off")
    assert ok == has_bf16_dot, why
    assert ok or why


def test_close_races_between_two_tokens_are_decided_exactly(isa):
    """Rows pulled equally toward two vocabulary rows of the same norm: their two logits lie
    within the bf16 error of each other, so the approximate order is often wrong and the filter
    must keep both (a bound 50x too small fails here)."""
    g = torch.Generator().manual_seed(5)
    V, K = 2048, 256
    w = torch.randn(V, K, generator=g)
    w = w / w.norm(dim=1, keepdim=True) * 16.0
    head, packed = _head(w)
    a, b = torch.randint(0, V, (2, 600), generator=g)
    x = w[a] + w[b] + torch.randn(600, K, generator=g) * 1e-3
    assert torch.equal(head.argmax(x), _full(x, packed, V))
