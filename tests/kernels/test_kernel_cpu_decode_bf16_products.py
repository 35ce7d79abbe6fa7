"""The bf16 mode's decode attention (``bf16_products=True`` over a bf16 cache,
csrc/paged_decode.c's qw_paged_decode_bf16_dp): on an AVX512_BF16 build, its two products run as
bf16 dot products with the AMX extend kernel's precision (the scaled query and the softmax
numerators rounded to bf16, fp32 sums, each row divided by the sum of its rounded numerators),
checked against a float64 oracle of exactly that; elsewhere (another head size, a build without
AVX512_BF16, an fp32 cache) it is the fp32-product kernel, bit for bit. The batches keep NaN in
every slot no sequence owns, so a read outside a sequence (the odd last token of a pair) shows."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from cpu_isa import isa  # noqa: F401  (fixture)
from kernel_testlib import generator, make_paged_batch, poisoned_like, random_lens

from kernels import cpu as kcpu
from kernels import paged_decode_attention_cpu

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")


def _has_dp() -> bool:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    return kcpu.cpu_isa() == "avx512" and "avx512_bf16" in flags


def _batch(gen, lens, bs, hkv, g, d, dtype):
    """fp32 queries over a cache of ``dtype`` (the poison stays NaN)."""
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=bs, num_kv_heads=hkv, group=g,
                             head_dim=d, dtype=torch.float32, device="cpu")
    return type(batch)(**{**batch.__dict__, "k_cache": batch.k_cache.to(dtype), "v_cache": batch.v_cache.to(dtype)})


def _oracle_bf16_products(batch, sliding_window=None, softcap=None) -> torch.Tensor:
    kc, vc = batch.k_cache.double(), batch.v_cache.double()
    bs, Hkv = kc.shape[1], kc.shape[2]
    q = (batch.q * batch.scale).bfloat16().double()  # the kernel scales in fp32, then rounds
    G = q.shape[1] // Hkv
    out = torch.empty_like(q)
    for row, (table, L) in enumerate(zip(batch.tables, batch.lens)):
        seen = [j for j in range(L) if sliding_window is None or L - 1 - j < sliding_window]
        keys = torch.stack([kc[table[j // bs], j % bs] for j in seen])
        vals = torch.stack([vc[table[j // bs], j % bs] for j in seen])
        for h in range(q.shape[1]):
            s = (keys[:, h // G] @ q[row, h]).float().double()  # fp32 sums
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            p = torch.exp(s - s.max()).float().bfloat16().double()
            out[row, h] = (p @ vals[:, h // G]) / p.sum()
    return out


CASES = [(16, 3, 3, 64), (16, 2, 1, 64), (32, 1, 8, 128), (16, 2, 5, 64), (16, 4, 2, 128),  # (block, Hkv, G, D)
         (1, 2, 3, 64), (3, 1, 4, 128),  # odd page sizes: one token at a time (never the AMX scores)
         (16, 1, 16, 64), (16, 8, 4, 128), (2, 2, 3, 64),  # AMX: a full C tile, items of 4 of 8 KV heads, 2-token pages
         (16, 1, 17, 64)]  # more query heads than a C tile's columns: dot products even on AMX


def _exact_inputs(batch, gen):
    """Small integers for q and K and a power-of-two scale: every score is exact in bf16 products
    and fp32 sums alike, a multiple of 1/8, so each softmax numerator exp(-j/8) is far from a bf16
    rounding midpoint (48 fp32 ulps at the closest) and the oracle's rounding is the kernel's."""
    k = torch.randint(-1, 2, batch.k_cache.shape, generator=gen).float()
    k = torch.where(torch.isnan(batch.k_cache.float()), torch.nan, k)  # the poison stays
    q = torch.randint(-2, 3, batch.q.shape, generator=gen).float()
    return type(batch)(**{**batch.__dict__, "q": q, "k_cache": k.bfloat16(), "scale": 0.125})


@pytest.mark.parametrize("bs,hkv,g,d", CASES)
@pytest.mark.parametrize("window", [None, 37])
@pytest.mark.parametrize("many", [True, False], ids=["10-seqs", "2-seqs"])  # whole sequences per item, or one KV head
def test_bf16_products_match_their_oracle(seed, isa, bs, hkv, g, d, window, many):
    if not _has_dp():
        pytest.skip(f"the {isa} build has no AVX512_BF16 dot products: bf16_products is the fp32-product kernel here "
                    "(test_elsewhere_it_is_the_fp32_product_kernel)")
    gen = generator(seed)
    lens = [int(x) for x in torch.randint(1, 6 * bs + 40, (7,), generator=gen)] + [1, 2, 3]  # the pairs' tails
    lens = lens if many else lens[:1] + [3]
    batch = _exact_inputs(_batch(gen, lens, bs, hkv, g, d, torch.bfloat16), gen)
    opts = {} if window is None else {"sliding_window": window}
    out = poisoned_like(batch.q)
    paged_decode_attention_cpu(*batch.decode_args(), out=out, bf16_products=True, **opts)
    want = _oracle_bf16_products(batch, sliding_window=window)
    err = (out.double() - want).abs().max().item()
    assert err <= 1e-5, f"bf16-product decode differs from its oracle by {err} (lens={lens})"


def test_the_scores_run_on_amx_tiles_where_the_cpu_has_them(isa):
    """An AMX CPU (or QWORKER_CPU_AMX_EMULATE=1) runs the scores on tiles for the shapes they
    take (paged_decode_amx.h), dot products for the others; elsewhere never the tiles."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    tiles = isa == "avx512" and _has_dp() and ({"amx_tile", "amx_bf16"} <= set(flags.split())
                                                or os.environ.get("QWORKER_CPU_AMX_EMULATE") == "1")
    dp = "avx512_bf16" if _has_dp() else None
    assert kcpu.decode_bf16_products_kernel(64, 3, 16) == ("amx" if tiles else dp)
    assert kcpu.decode_bf16_products_kernel(128, 16, 32) == ("amx" if tiles else dp)
    assert kcpu.decode_bf16_products_kernel(64, 17, 16) == dp  # more query heads than a tile's columns
    assert kcpu.decode_bf16_products_kernel(64, 3, 3) == dp  # an odd page size
    assert kcpu.decode_bf16_products_kernel(80, 3, 16) is None


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_bf16_products_on_random_inputs(seed, isa, softcap):
    """Random inputs, soft-capping included: within bf16 rounding of the fp32-product kernel (a
    numerator that lands within an ulp of a bf16 midpoint may round either way), and not equal to
    it (the rounding is there)."""
    if not _has_dp():
        pytest.skip(f"the {isa} build has no AVX512_BF16 dot products")
    gen = generator(seed)
    lens = random_lens(gen, 6, 16, 200) + [1, 2]
    batch = _batch(gen, lens, 16, 3, 3, 64, torch.bfloat16)
    opts = {} if softcap is None else {"softcap": softcap}
    dp = paged_decode_attention_cpu(*batch.decode_args(), bf16_products=True, **opts)
    plain = paged_decode_attention_cpu(*batch.decode_args(), **opts)
    assert torch.isfinite(dp).all()
    assert (dp - plain).abs().max().item() <= 0.05 and not torch.equal(dp, plain)


@pytest.mark.parametrize("d", [32, 80, 64])
def test_elsewhere_it_is_the_fp32_product_kernel(seed, isa, d):
    """Head sizes without the GQA kernels (32, 80), builds without AVX512_BF16 (every head size),
    and fp32 caches: the same bits as without bf16_products."""
    gen = generator(seed)
    lens = random_lens(gen, 5, 16, 90)
    for dtype in (torch.bfloat16, torch.float32):
        batch = _batch(gen, lens, 16, 2, 3, d, dtype)
        plain = paged_decode_attention_cpu(*batch.decode_args())
        dp = paged_decode_attention_cpu(*batch.decode_args(), bf16_products=True)
        if dtype == torch.bfloat16 and d == 64 and _has_dp():
            continue  # the dot-product path: test_bf16_products_match_their_oracle
        assert torch.equal(plain, dp), f"{isa} D={d} {dtype}"


@pytest.mark.parametrize("bs,window", [(16, None), (16, 37), (32, 45), (1, None), (3, 20), (2, 7)])
def test_the_bits_do_not_depend_on_where_the_pages_lie(seed, isa, bs, window):
    """The same sequences over pages with consecutive ids (walked as one run) and over the same
    pages at shuffled ids: the V products pair tokens (2m, 2m + 1) by position either way, a
    window's odd first token alone (helper-40: a run paired them from the chunk's start)."""
    gen = generator(seed)
    B, Hkv, G, D = 3, 3, 3, 64
    lens = [int(x) for x in torch.randint(30, 140, (B,), generator=gen)]
    need = [-(-L // bs) for L in lens]
    k = torch.randn(sum(need), bs, Hkv, D, generator=gen).bfloat16()
    v = torch.randn(sum(need), bs, Hkv, D, generator=gen).bfloat16()
    q = torch.randn(B, Hkv * G, D, generator=gen)
    width = max(need)
    runs = torch.zeros(B, width, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        runs[b, :n] = torch.arange(at, at + n)
        at += n
    perm = torch.randperm(sum(need), generator=gen)  # page i moves to id perm[i]
    k2, v2 = torch.empty_like(k), torch.empty_like(v)
    k2[perm], v2[perm] = k, v
    shuffled = torch.where(runs >= 0, perm[runs.long()].int(), runs)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    opts = {} if window is None else {"sliding_window": window}
    a = paged_decode_attention_cpu(q, k, v, runs, lens_t, 0.125, bf16_products=True, **opts)
    b = paged_decode_attention_cpu(q, k2, v2, shuffled, lens_t, 0.125, bf16_products=True, **opts)
    assert torch.equal(a, b), f"bs={bs} window={window}: {(a - b).abs().max().item()}"


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("many", [True, False], ids=["10-seqs", "1-seq"])
def test_a_non_finite_key_stays_in_its_own_kv_head(seed, isa, bad, many):
    """helper-126: with the scores on AMX tiles, an item holding several KV heads multiplied each
    head's K by the zeros of the other heads' q columns, so an Inf in one head's K (Inf * 0 = NaN)
    reached every head's scores, and only when the batch was large enough for whole-sequence items.
    Every other KV head's output must be exactly what it is without the bad value; a NaN score
    makes its own head's output NaN."""
    gen = generator(seed)
    hkv, g, d, bs = 3, 2, 64, 16
    lens = ([int(x) for x in torch.randint(20, 90, (10,), generator=gen)] if many else [57])
    batch = _batch(gen, lens, bs, hkv, g, d, torch.bfloat16)
    clean = paged_decode_attention_cpu(*batch.decode_args(), bf16_products=True)
    k = batch.k_cache.clone()
    tok = 11  # a live token of sequence 0, KV head 1
    k[batch.tables[0][tok // bs], tok % bs, 1, 5] = bad
    spoiled = type(batch)(**{**batch.__dict__, "k_cache": k})
    out = paged_decode_attention_cpu(*spoiled.decode_args(), bf16_products=True)
    others = [h for h in range(hkv * g) if h // g != 1]
    assert torch.equal(out[:, others], clean[:, others])
    assert torch.equal(out[1:], clean[1:])  # the other sequences
    if bad != bad:  # NaN
        assert torch.isnan(out[0, g : 2 * g]).all()
