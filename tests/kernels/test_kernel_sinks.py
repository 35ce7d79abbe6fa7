"""Attention sinks (gpt-oss: one more logit per query head in the softmax, with no value) in every
attention kernel: the torch references, the C decode and extend kernels under each ISA build
this CPU runs (and the bf16-products ones, loosely), and the Triton kernels (native on CUDA, the
interpreter here), against the float64 oracle; with windows, GQA, a decode row beside prompts
and prefix hits, and sinks large enough to take most of the weight."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from cpu_isa import isa  # noqa: F401  (fixture)
from kernel_testlib import assert_close, generator, make_paged_batch, oracle_attention

import kernels
from kernels import cpu as kcpu
from kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

CASES = [  # (block_size, Hkv, G, D, lens, q_lens)
    (16, 2, 4, 64, [1, 20, 37, 70], [1, 20, 9, 33]),  # a decode row, a prompt, prefix hits
    (16, 1, 8, 128, [65, 40], [30, 40]),
    (8, 2, 2, 96, [75, 3], [75, 1]),
]
no_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")


def _sinks(gen: torch.Generator, hq: int) -> torch.Tensor:
    """Logits around the scores' range and beyond (a sink that takes most of a head's weight)."""
    return (torch.randn(hq, generator=gen) * 2 + torch.tensor([4.0 if h % 3 == 0 else 0.0 for h in range(hq)])).float()


def _batch_and_sinks(seed, case, dtype=torch.float32, device="cpu"):
    bs, hkv, g, d, lens, q_lens = case
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=bs, num_kv_heads=hkv, group=g, head_dim=d, dtype=dtype,
                             device=device, poison=0.0)
    return batch, _sinks(gen, hkv * g).to(device)


def _decode_rows(batch):
    """The batch's sequences that have one query row, as a decode call's inputs."""
    rows = [i for i, ql in enumerate(batch.q_lens) if ql == 1]
    starts = batch.query_start_loc.tolist()
    idx = torch.tensor(rows, dtype=torch.long)
    return rows, batch.q[[starts[r] for r in rows]], batch.block_tables[idx], batch.seq_lens[idx]


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("case", CASES)
def test_references_follow_the_oracle(case, window):
    batch, sinks = _batch_and_sinks(1, case)
    want = oracle_attention(batch, sliding_window=window, sinks=sinks)
    out = paged_prefill_attention_ref(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
                                      batch.seq_lens, batch.scale, batch.max_query_len, sliding_window=window, sinks=sinks)
    assert_close(out, want, torch.float32, f"prefill reference W={window}")
    plain = oracle_attention(batch, sliding_window=window)
    assert (want - plain).abs().max() > 0.05  # the sinks do change the result


@no_cc
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("case", CASES)
def test_cpu_kernels_follow_the_oracle(isa, case, window, cache_dtype, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a C kernel fell back to the torch reference")
    monkeypatch.setattr(kcpu, "paged_prefill_attention_ref", refuse)
    monkeypatch.setattr(kcpu, "paged_decode_attention_ref", refuse)
    batch, sinks = _batch_and_sinks(2, case)
    k, v = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    batch.k_cache, batch.v_cache = k.float(), v.float()  # the oracle reads what the cache holds
    want = oracle_attention(batch, sliding_window=window, sinks=sinks)
    out = kcpu.paged_prefill_attention_cpu(batch.q, k, v, batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale,
                                           batch.max_query_len, sliding_window=window, sinks=sinks)
    assert_close(out, want, torch.float32, f"cpu extend {isa} {cache_dtype} W={window}")
    rows, q, tables, lens = _decode_rows(batch)
    if rows:
        got = kcpu.paged_decode_attention_cpu(q, k, v, tables, lens, batch.scale, sliding_window=window, sinks=sinks)
        starts = batch.query_start_loc.tolist()
        assert_close(got, want[[starts[r] for r in rows]], torch.float32, f"cpu decode {isa} {cache_dtype} W={window}")


@no_cc
@pytest.mark.parametrize("case", CASES[:2])
def test_cpu_bf16_product_kernels_follow_the_reference_loosely(case):
    """The bf16 mode's kernels multiply in bf16: as close to the fp32 reference as without sinks."""
    batch, sinks = _batch_and_sinks(3, case)
    k, v = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    args = (batch.q, k, v, batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.scale, batch.max_query_len)
    ref = paged_prefill_attention_ref(*args, sinks=sinks)
    out = kcpu.paged_prefill_attention_cpu(*args, sinks=sinks, bf16_products=True)
    assert (out - ref).abs().max() < 0.02
    rows, q, tables, lens = _decode_rows(batch)
    if rows:
        ref = paged_decode_attention_ref(q, k, v, tables, lens, batch.scale, sinks=sinks)
        got = kcpu.paged_decode_attention_cpu(q, k, v, tables, lens, batch.scale, sinks=sinks, bf16_products=True)
        assert (got - ref).abs().max() < 0.02


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 24])
def test_triton_kernels_follow_the_oracle(device, window, num_splits):
    """Decode in one split (the kernel normalises) and in several (the reduce kernel does)."""
    batch, sinks = _batch_and_sinks(4, (16, 2, 2, 32, [1, 50, 37], [1, 50, 9]), device=device)
    want = oracle_attention(batch, sliding_window=window, sinks=sinks)
    out = kernels.paged_prefill_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc,
                                          batch.seq_lens, batch.scale, batch.max_query_len, sliding_window=window, sinks=sinks,
                                          block_m=16, block_n=16)
    assert_close(out, want, torch.float32, f"triton prefill W={window}")
    rows, q, tables, lens = _decode_rows(batch)
    got = kernels.paged_decode_attention(q, batch.k_cache, batch.v_cache, tables, lens, batch.scale, num_splits,
                                         sliding_window=window, sinks=sinks, block_n=16)
    starts = batch.query_start_loc.tolist()
    assert_close(got, want[[starts[r] for r in rows]], torch.float32, f"triton decode W={window} splits={num_splits}")
