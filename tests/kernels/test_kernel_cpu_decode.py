"""The CPU engine's C decode kernel (kernels/csrc) against the float64 oracle and the reference.

The kernel reads only live slots, so these batches keep their NaN-poisoned unowned slots and
garbage table padding (the reference needs them zeroed): any read outside a sequence's pages,
or any output element left unwritten, shows up as NaN.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from cpu_isa import isa  # noqa: F401  (fixture)
from kernel_testlib import assert_close, generator, make_paged_batch, oracle_attention, poisoned_like, random_lens

from kernels import cpu_kernels_available, paged_decode_attention_cpu, paged_decode_attention_ref

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")

CASES = [  # (block_size, Hkv, G, D)
    (16, 3, 3, 64),  # SmolLM2's shape
    (16, 2, 1, 64),
    (32, 1, 8, 128),
    (32, 2, 4, 64),
    (16, 4, 4, 128),
]


def test_builds_on_this_machine():
    assert cpu_kernels_available(), "the C kernel failed to build (see the log warning); the CPU engine would run the slow reference"


@pytest.mark.parametrize("bs,hkv,g,d", CASES)
def test_matches_oracle(seed, isa, bs, hkv, g, d):
    gen = generator(seed)
    lens = random_lens(gen, 6, bs, 5 * bs + 7)
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=bs, num_kv_heads=hkv, group=g,
                             head_dim=d, dtype=torch.float32, device="cpu")
    out = poisoned_like(batch.q)
    res = paged_decode_attention_cpu(*batch.decode_args(), out=out)
    assert res.data_ptr() == out.data_ptr()
    assert_close(out, oracle_attention(batch).float(), torch.float32, f"cpu decode {isa} lens={lens}")


def test_long_contexts_match_reference(seed, isa):
    """Contexts of hundreds of tokens (the oracle's per-token loop would be slow here)."""
    gen = generator(seed)
    lens = [int(x) for x in torch.randint(1, 900, (5,), generator=gen)] + [1, 16 * 40]
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=16, num_kv_heads=3, group=3,
                             head_dim=64, dtype=torch.float32, device="cpu")
    out = paged_decode_attention_cpu(*batch.decode_args())
    ref = paged_decode_attention_ref(*batch.finite().decode_args())
    assert_close(out, ref, torch.float32, f"cpu decode long lens={lens}")


def test_writes_into_rows_of_a_larger_output(seed):
    """The engine passes ``q[:n]`` and ``out=out[:n]`` of a mixed decode+prefill step; rows after
    ``n`` must stay untouched."""
    gen = generator(seed)
    lens = random_lens(gen, 4, 16, 80)
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * 4, block_size=16, num_kv_heads=2, group=3,
                             head_dim=64, dtype=torch.float32, device="cpu")
    big = torch.full((7, *batch.q.shape[1:]), 7.0)
    paged_decode_attention_cpu(batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.scale, out=big[:4])
    assert_close(big[:4], oracle_attention(batch).float(), torch.float32, "rows of a larger output")
    assert torch.equal(big[4:], torch.full_like(big[4:], 7.0))


def test_int64_tables_and_extreme_scores(seed):
    """Block tables as int64 are accepted; large logits (scores of +-80) stay finite and exact."""
    gen = generator(seed)
    lens = [33, 1, 70]
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * 3, block_size=16, num_kv_heads=1, group=4, head_dim=64,
                             dtype=torch.float32, device="cpu")
    q = batch.q * 40.0
    out = paged_decode_attention_cpu(q, batch.k_cache, batch.v_cache, batch.block_tables.long(), batch.seq_lens, batch.scale)
    ref = paged_decode_attention_ref(q.double(), *[t.double() for t in (batch.finite().k_cache, batch.finite().v_cache)],
                                     batch.block_tables, batch.seq_lens, batch.scale)
    assert_close(out, ref.float(), torch.float32, "extreme scores")


def test_uncovered_inputs_fall_back_to_the_reference(seed):
    """float64 (and any non-fp32 dtype) runs the reference, with the same result."""
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=[5, 40], q_lens=[1, 1], block_size=16, num_kv_heads=2, group=2, head_dim=64,
                             dtype=torch.float64, device="cpu").finite()
    out = paged_decode_attention_cpu(*batch.decode_args())
    assert out.dtype == torch.float64
    assert_close(out, oracle_attention(batch), torch.float64, "float64 fallback")


@pytest.mark.parametrize("bs,hkv,g,d", [(16, 3, 3, 64), (32, 2, 4, 128)])
def test_fp16_cache_matches_oracle(seed, isa, bs, hkv, g, d):
    """An fp16 cache with fp32 queries (the CPU engine's ``kv_cache_dtype="float16"``): exact up to
    fp32 rounding against the oracle on the same half-precision values."""
    gen = generator(seed)
    lens = random_lens(gen, 5, bs, 6 * bs)
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=bs, num_kv_heads=hkv, group=g,
                             head_dim=d, dtype=torch.float32, device="cpu")
    k16, v16 = batch.k_cache.half(), batch.v_cache.half()
    out = poisoned_like(batch.q)
    paged_decode_attention_cpu(batch.q, k16, v16, batch.block_tables, batch.seq_lens, batch.scale, out=out)
    exact = oracle_attention(type(batch)(**{**batch.__dict__, "k_cache": k16.double(), "v_cache": v16.double()}))
    assert_close(out, exact.float(), torch.float32, f"fp16 cache lens={lens}")


@pytest.mark.parametrize("bs,hkv,g,d", [(16, 3, 3, 64), (32, 2, 4, 128)])
def test_bf16_cache_matches_oracle(seed, isa, bs, hkv, g, d):
    """A bf16 cache with fp32 queries (``kv_cache_dtype="bfloat16"``): exact up to fp32 rounding
    against the oracle on the same bf16 values."""
    gen = generator(seed)
    lens = random_lens(gen, 5, bs, 6 * bs)
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=bs, num_kv_heads=hkv, group=g,
                             head_dim=d, dtype=torch.float32, device="cpu")
    kb, vb = batch.k_cache.bfloat16(), batch.v_cache.bfloat16()
    out = poisoned_like(batch.q)
    paged_decode_attention_cpu(batch.q, kb, vb, batch.block_tables, batch.seq_lens, batch.scale, out=out)
    exact = oracle_attention(type(batch)(**{**batch.__dict__, "k_cache": kb.double(), "v_cache": vb.double()}))
    assert_close(out, exact.float(), torch.float32, f"bf16 cache lens={lens}")


def test_out_of_range_block_ids_raise_before_reading(seed):
    """A live block-table entry outside the cache is refused (IndexError, like the reference's
    indexing), never read; padding entries past a sequence's pages are still ignored."""
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=[20, 3], q_lens=[1, 1], block_size=16, num_kv_heads=2, group=2, head_dim=64,
                             dtype=torch.float32, device="cpu")
    bad = batch.block_tables.clone()
    bad[0, 1] = batch.k_cache.shape[0] + 5  # the second page of the 20-token sequence
    with pytest.raises(IndexError):
        paged_decode_attention_cpu(batch.q, batch.k_cache, batch.v_cache, bad, batch.seq_lens, batch.scale)


def test_rows_without_sequences_are_refused():
    """Review regression: more query rows than sequence lengths or block-table rows made the C
    kernel read past them (a segfault with 3 rows and no sequences); now a clear ValueError."""
    q = torch.randn(3, 4, 16)
    k = torch.zeros(8, 16, 2, 16)
    with pytest.raises(ValueError, match="3 query rows but 0 sequence lengths"):
        paged_decode_attention_cpu(q, k, k.clone(), torch.zeros(0, 1, dtype=torch.int32),
                                           torch.zeros(0, dtype=torch.int32), 0.25)
    with pytest.raises(ValueError, match="1 block-table rows"):
        paged_decode_attention_cpu(q, k, k.clone(), torch.zeros(1, 1, dtype=torch.int32),
                                           torch.ones(3, dtype=torch.int32), 0.25)
