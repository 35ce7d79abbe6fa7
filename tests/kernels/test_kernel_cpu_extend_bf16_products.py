"""The CPU bf16 mode's extend (prefill) kernel with its products in bf16
(``csrc/paged_extend_bf16_products.c``, ``paged_prefill_attention_cpu(..., bf16_products=True)``):
on AMX tiles where the CPU and OS give AMX, else AVX512_BF16 dot products. Checked against the
float64 oracle on the cache's values, to bf16 accuracy (queries and probabilities are rounded to
bf16, as torch's bf16 flash attention does). Where it does not apply (head sizes that are not a
multiple of 32, builds without AVX512_BF16) it must be the fp32 kernel, bit for bit.

The oracle tests run the back-end this CPU has (skipped with the reason where it has neither); the
fallback tests run everywhere.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from kernel_testlib import assert_close, generator, make_paged_batch, oracle_attention, poison_before_window, poisoned_like

import kernels
from kernels import cpu as kcpu

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")
KERNEL = kcpu.extend_bf16_products_kernel(64)
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="this CPU has neither AMX (granted by the OS) nor AVX512_BF16")


@pytest.fixture
def no_fallback(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the extend kernel fell back to the torch reference")
    monkeypatch.setattr(kcpu, "paged_prefill_attention_ref", refuse)


def bf16_batch(gen, **kw):
    batch = make_paged_batch(gen, dtype=torch.float32, device="cpu", **kw)
    return type(batch)(**{**batch.__dict__, "k_cache": batch.k_cache.to(torch.bfloat16),
                          "v_cache": batch.v_cache.to(torch.bfloat16)})


CASES = [  # (block_size, Hkv, G, D, lens, q_lens)
    (16, 3, 3, 64, [1, 20, 37, 70], [1, 20, 9, 33]),  # SmolLM2's heads: a decode row, a prompt, prefix hits
    (16, 2, 1, 64, [48, 5], [48, 5]),  # prompts ending on and before a block edge
    (32, 1, 8, 128, [65, 40], [30, 40]),  # G 8, D 128 (two groups of four column tiles)
    (16, 2, 4, 96, [50, 17], [50, 2]),  # D 96: six column tiles (a group of four, then two)
    (8, 2, 2, 64, [75], [75]),  # more than one item of query rows, chunk edges off the block edges
    (16, 3, 3, 64, [300, 420, 260], [300, 150, 1]),  # hundreds of tokens: many chunks and row tiles
]


@needs_kernel
@pytest.mark.parametrize("bs,hkv,g,d,lens,q_lens", CASES)
def test_matches_oracle_to_bf16(seed, no_fallback, bs, hkv, g, d, lens, q_lens):
    gen = generator(seed)
    batch = bf16_batch(gen, lens=lens, q_lens=q_lens, block_size=bs, num_kv_heads=hkv, group=g, head_dim=d)
    want = oracle_attention(batch).float()
    out = poisoned_like(batch.q)
    res = kernels.paged_prefill_attention_cpu(*batch.args(), out=out, bf16_products=True)
    assert res.data_ptr() == out.data_ptr()
    assert_close(out, want, torch.bfloat16, f"{KERNEL} extend lens={lens} q_lens={q_lens}")
    # and it is not the fp32 kernel under another name: bf16 products differ from fp32 ones
    fp32 = kernels.paged_prefill_attention_cpu(*batch.args())
    assert not torch.equal(out, fp32)


@needs_kernel
@pytest.mark.parametrize("bs,hkv,g,d,w,cap", [
    (16, 3, 3, 64, 5, None),  # inside one block
    (16, 2, 1, 64, 16, 3.0),  # one whole block
    (16, 2, 4, 128, 37, None),  # starts mid-page
    (32, 1, 8, 64, 1, 3.0),  # a query sees only itself
    (16, 2, 2, 64, 500, 3.0),  # over every context
    (16, 2, 2, 64, None, 3.0),  # softcap alone
])
def test_window_softcap_match_oracle_to_bf16(seed, no_fallback, bs, hkv, g, d, w, cap):
    gen = generator(seed)
    lens, q_lens = [1, 9, 3 * bs + 5, 5 * bs, 70], [1, 9, 6, 40, 1]
    batch = bf16_batch(gen, lens=lens, q_lens=q_lens, block_size=bs, num_kv_heads=hkv, group=g, head_dim=d)
    batch.q.mul_(2.0)  # logits large enough for the cap to bite
    want = oracle_attention(batch, w, cap).float()
    if w is not None:  # blocks wholly before every window are NaN: reading one shows
        batch, poisoned = poison_before_window(batch, w)
        assert poisoned > 0 or w >= max(lens)
    out = poisoned_like(batch.q)
    kernels.paged_prefill_attention_cpu(*batch.args(), out=out, sliding_window=w, softcap=cap, bf16_products=True)
    assert_close(out, want, torch.bfloat16, f"{KERNEL} extend W={w} cap={cap}")


@needs_kernel
def test_writes_only_its_rows_and_a_row_is_independent_of_its_batch(seed, no_fallback):
    """The engine passes ``out=out[nd:]`` of a mixed step; and a sequence's output must not depend
    on which other sequences share the step (the work split differs with the batch)."""
    gen = generator(seed)
    batch = bf16_batch(gen, lens=[30, 19, 90], q_lens=[12, 19, 70], block_size=16, num_kv_heads=2, group=3, head_dim=64)
    big = torch.full((4 + batch.q.shape[0], *batch.q.shape[1:]), 7.0)
    kernels.paged_prefill_attention_cpu(*batch.args(), out=big[4:], bf16_products=True)
    assert torch.equal(big[:4], torch.full_like(big[:4], 7.0))
    q, k, v, tables, starts, lens, scale, _ = batch.args()
    alone = kernels.paged_prefill_attention_cpu(q[31:], k, v, tables[2:], starts[2:] - 31, lens[2:], scale, 70,
                                                bf16_products=True)
    assert torch.equal(alone, big[4 + 31:])


@needs_kernel
def test_many_threads_same_bits(seed, no_fallback):
    gen = generator(seed)
    batch = bf16_batch(gen, lens=[200, 64, 33], q_lens=[200, 64, 20], block_size=16, num_kv_heads=3, group=3, head_dim=64)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.paged_prefill_attention_cpu(*batch.args(), bf16_products=True)
        torch.set_num_threads(max(2, before))
        many = kernels.paged_prefill_attention_cpu(*batch.args(), bf16_products=True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_where_it_does_not_apply_it_is_the_fp32_kernel(seed, no_fallback):
    """D = 72 (not a multiple of 32) everywhere, and any D where this CPU has neither back-end:
    bit for bit the fp32 kernel's output. An fp32 cache ignores the flag."""
    gen = generator(seed)
    dims = [72] if KERNEL else [64, 72]
    for d in dims:
        batch = bf16_batch(gen, lens=[40, 9], q_lens=[40, 3], block_size=16, num_kv_heads=2, group=2, head_dim=d)
        assert kcpu.extend_bf16_products_kernel(d) is None
        assert torch.equal(kernels.paged_prefill_attention_cpu(*batch.args(), bf16_products=True),
                           kernels.paged_prefill_attention_cpu(*batch.args()))
    f32 = make_paged_batch(gen, lens=[40], q_lens=[40], block_size=16, num_kv_heads=2, group=2, head_dim=64,
                           dtype=torch.float32, device="cpu")
    assert torch.equal(kernels.paged_prefill_attention_cpu(*f32.args(), bf16_products=True),
                       kernels.paged_prefill_attention_cpu(*f32.args()))


@pytest.mark.skipif("avx2" not in kcpu.available_isas(), reason="this CPU cannot run the avx2 build")
def test_the_avx2_build_has_neither_back_end(seed, no_fallback):
    """The avx2 build is compiled without AVX-512, so AVX512_BF16 and AMX are out of it: the flag
    gives the fp32 kernel there, whatever the CPU."""
    gen = generator(seed)
    batch = bf16_batch(gen, lens=[40, 9], q_lens=[40, 3], block_size=16, num_kv_heads=3, group=3, head_dim=64)
    with kcpu.using_isa("avx2"):
        assert kcpu.extend_bf16_products_kernel(64) is None
        assert torch.equal(kernels.paged_prefill_attention_cpu(*batch.args(), bf16_products=True),
                           kernels.paged_prefill_attention_cpu(*batch.args()))


@needs_kernel
def test_out_of_range_block_ids_raise_before_reading(seed):
    gen = generator(seed)
    batch = bf16_batch(gen, lens=[40, 3], q_lens=[8, 3], block_size=16, num_kv_heads=2, group=2, head_dim=64)
    args = list(batch.args())
    args[3] = batch.block_tables.clone()
    args[3][0, 1] = batch.k_cache.shape[0] + 5
    with pytest.raises(IndexError):
        kernels.paged_prefill_attention_cpu(*args, bf16_products=True)


@needs_kernel
@pytest.mark.parametrize("window", [64, 37, 1])
def test_a_windowed_token_has_the_same_bits_however_its_prompt_was_split(seed, no_fallback, window):
    """Chunked prefill splits a prompt at any token: the rows after the split must come out as in
    the one-step prefill. With a window, an item's first key is then odd or even by the split, and
    the P . V pairs must still be the same keys (found by an attack: pairs counted from that first
    key changed ~1 ulp in rows after an odd split)."""
    gen = generator(seed)
    n = 300
    whole = bf16_batch(gen, lens=[n], q_lens=[n], block_size=16, num_kv_heads=3, group=3, head_dim=64)
    q, k, v, tables, starts, lens, scale, _ = whole.args()
    full = kernels.paged_prefill_attention_cpu(q, k, v, tables, starts, lens, scale, n, sliding_window=window,
                                               bf16_products=True)
    for prefix in (1, 2, 3, 17, 150, 151):
        rest = kernels.paged_prefill_attention_cpu(q[prefix:], k, v, tables, torch.tensor([0, n - prefix]), lens, scale,
                                                   n - prefix, sliding_window=window, bf16_products=True)
        assert torch.equal(rest, full[prefix:]), f"window {window}, split after {prefix} tokens"


@pytest.mark.parametrize("bf16_products", [False, True])
def test_a_window_past_int32_is_no_window(seed, no_fallback, bf16_products):
    """``sliding_window`` of 2**31 - 1 or more is passed as INT_MAX, which must mean no window (an
    int overflow in the rows-that-see-a-chunk test once made every row NaN), in both kernels."""
    gen = generator(seed)
    batch = bf16_batch(gen, lens=[40, 70], q_lens=[40, 30], block_size=16, num_kv_heads=2, group=2, head_dim=64)
    none = kernels.paged_prefill_attention_cpu(*batch.args(), bf16_products=bf16_products)
    assert torch.isfinite(none).all()
    for w in (2**31 - 2, 2**31 - 1, 2**40):
        out = kernels.paged_prefill_attention_cpu(*batch.args(), sliding_window=w, bf16_products=bf16_products)
        assert torch.equal(out, none), f"window {w}"
