"""``PagedAttention(backend, scale, sliding_window, softcap)``: both backends pass the layer's options
to every kernel call of a step, for pure-decode, pure-prefill and mixed (decodes first) steps."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import assert_close, generator, make_paged_batch, oracle_attention

from qworker.model.attention import AttentionMetadata, PagedAttention


def _step(batch, device):
    """The metadata of one step over ``batch`` and its new tokens' K/V (read back from the cache,
    so that the layer's store writes the same values again)."""
    bs, hkv, d = batch.k_cache.shape[1:]
    slots = []
    for table, L, ql in zip(batch.tables, batch.lens, batch.q_lens):
        slots += [table[j // bs] * bs + j % bs for j in range(L - ql, L)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    k = batch.k_cache.view(-1, hkv, d)[slot_mapping].clone()
    v = batch.v_cache.view(-1, hkv, d)[slot_mapping].clone()
    meta = AttentionMetadata(slot_mapping=slot_mapping, block_tables=batch.block_tables,
                             query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens,
                             max_query_len=batch.max_query_len, num_decodes=sum(ql == 1 for ql in batch.q_lens))
    return k, v, meta


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 1, 9], [17, 3, 9]], ids=["decode", "mixed", "prefill"])
@pytest.mark.parametrize("window,cap", [(6, None), (None, 2.0), (5, 2.0), (None, None)])
def test_layer_passes_its_options(seed, device, backend, q_lens, window, cap):
    dev = device if backend == "triton" else torch.device("cpu")
    gen = generator(seed)
    lens = [23, 13, 17] if q_lens[0] == 1 else [17, 13, 17]
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=4, num_kv_heads=2, group=2, head_dim=16,
                             dtype=torch.float32, device=dev, poison=0.0)
    batch.q.mul_(2.0)
    k, v, meta = _step(batch, dev)
    layer = PagedAttention(backend, batch.scale, sliding_window=window, softcap=cap)
    out = layer(batch.q, k, v, batch.k_cache, batch.v_cache, meta)
    assert_close(out, oracle_attention(batch, window, cap).float(), torch.float32, f"{backend} {q_lens} W={window}")


def test_rejects_meaningless_options():
    with pytest.raises(ValueError):
        PagedAttention("cpu", 0.1, sliding_window=0)
    with pytest.raises(ValueError):
        PagedAttention("cpu", 0.1, softcap=0.0)
