"""Llama 4's chunked local attention beyond what every family runs (tests/engine/test_model_families.py
checks its tokens against transformers with chunks of 32 tokens, under preemption, chunked prefill
and prefix hits): the virtual sequences of :func:`qworker.model.attention.chunked_metadata` give
every query exactly the keys of its own chunk, for decode rows and prompt pieces that start,
cross or end at chunk boundaries; a block size that does not divide the chunk is refused."""

from __future__ import annotations

import random

import pytest
import torch

from qworker import LLM
from qworker.model.attention import AttentionMetadata, PagedAttention, chunked_metadata
from tests.engine.family_models import build_family_model

H, D = 2, 16


def _reference(q, keys, values, positions, chunk, scale):
    """Each query row against its chunk's keys, in float64, from the definition."""
    out = torch.empty_like(q, dtype=torch.float64)
    for r, p in enumerate(positions):
        lo = p // chunk * chunk
        k, v = keys[lo:p + 1].double(), values[lo:p + 1].double()  # [n, H, D]
        scores = torch.einsum("hd,nhd->hn", q[r].double(), k) * scale
        out[r] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out.float()


@pytest.mark.parametrize("block_size,chunk", [(4, 8), (8, 8), (4, 12), (16, 32)])
def test_every_query_sees_exactly_its_chunk(block_size, chunk):
    rng = random.Random(block_size * 100 + chunk)
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    # decodes first (one query each), then prompt pieces: from 0, mid-chunk, ending on a boundary, spanning several chunks
    seqs = [(rng.randrange(1, 5 * chunk), 1) for _ in range(3)] + [(3 * chunk + 5, 3 * chunk + 5), (2 * chunk + 3, chunk),
                                                                  (2 * chunk, chunk // 2), (chunk - 1, chunk - 2)]
    num_blocks = sum(-(-n // block_size) for n, _ in seqs) + 2
    k_cache = torch.zeros(num_blocks, block_size, H, D)
    v_cache = torch.zeros_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots, query_start, rows = [], [], [0], []
    keys_of, values_of = [], []
    q_rows = []
    for n, q_len in seqs:
        table = [free.pop() for _ in range(-(-n // block_size))]
        tables.append(table)
        keys, values = torch.randn(n, H, D, generator=gen), torch.randn(n, H, D, generator=gen)
        keys_of.append(keys)
        values_of.append(values)
        for p in range(n):  # the context already cached, the new tokens stored by the call (slot_mapping)
            target = (k_cache, v_cache) if p < n - q_len else None
            if target:
                k_cache[table[p // block_size], p % block_size] = keys[p]
                v_cache[table[p // block_size], p % block_size] = values[p]
        for p in range(n - q_len, n):
            slots.append(table[p // block_size] * block_size + p % block_size)
            rows.append((len(tables) - 1, p))
        query_start.append(query_start[-1] + q_len)
        q_rows.append(torch.randn(q_len, H, D, generator=gen))
    width = max(map(len, tables))
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots), block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                                                                             dtype=torch.int32),
                             query_start_loc=torch.tensor(query_start, dtype=torch.int32),
                             seq_lens=torch.tensor([n for n, _ in seqs], dtype=torch.int32),
                             max_query_len=max(q for _, q in seqs), num_decodes=3)
    q = torch.cat(q_rows)
    new_k = torch.cat([keys_of[b][p:p + 1] for b, p in rows])
    new_v = torch.cat([values_of[b][p:p + 1] for b, p in rows])
    local = chunked_metadata(meta, chunk, block_size)
    assert local.num_decodes == 3 and int(local.query_start_loc[-1]) == q.shape[0]
    out = PagedAttention("cpu", scale=D**-0.5)(q, new_k, new_v, k_cache, v_cache, local)
    for i, (b, p) in enumerate(rows):
        expected = _reference(q[i:i + 1], keys_of[b], values_of[b], [p], chunk, D**-0.5)
        torch.testing.assert_close(out[i:i + 1], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"row {i} (seq {b}, position {p}): {m}")


def test_a_block_size_that_does_not_divide_the_chunk_is_refused(tmp_path, model_dir):
    path = build_family_model("llama4_text", tmp_path / "m", model_dir)  # chunks of 32
    with pytest.raises(ValueError, match="block_size=64 must divide llama4_text's attention_chunk_size=32"):
        LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=64)


@pytest.mark.parametrize("chunk,why", [(-32, "attention_chunk_size is -32 \\(a positive number of tokens\\)"),
                                       (32.0, "config.json: .*attention_chunk_size")])
def test_a_malformed_chunk_size_is_refused_in_one_line(tmp_path, model_dir, chunk, why):
    """helper-96: -32 passed every check and the first step looped until memory ran out; 32.0 failed
    in the tokenizer's load with transformers' multi-line validation error."""
    import json

    path = build_family_model("llama4_text", tmp_path / "m", model_dir)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_chunk_size": chunk}))
    with pytest.raises(ValueError, match=why) as info:
        LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    assert "\n" not in str(info.value)
