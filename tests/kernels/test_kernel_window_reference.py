"""Sliding-window attention and logit soft-capping in the torch references, against a dense
masked attention built here from the definition (and the per-token oracle).

Windows smaller than, equal to and larger than the context, windows that are not a multiple of
the block size, decode rows, whole prompts and chunks after a cached prefix, GQA, fp64/fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testlib import assert_close, generator, make_paged_batch, oracle_attention, poisoned_like

from kernels import paged_attention_ref, paged_decode_attention_ref, paged_prefill_attention_ref


def dense_attention(batch, sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """Each sequence's K/V laid out densely, a full ``[q_len, L]`` score matrix per head, the mask
    written from the definition (``p - W < j <= p``), softcap before the mask: float64."""
    kc, vc, q = batch.k_cache.double(), batch.v_cache.double(), batch.q.double()
    bs, hkv = kc.shape[1], kc.shape[2]
    out, row = [], 0
    for table, L, ql in zip(batch.tables, batch.lens, batch.q_lens):
        k = torch.cat([kc[b] for b in table])[:L].transpose(0, 1)  # [Hkv, L, D]
        v = torch.cat([vc[b] for b in table])[:L].transpose(0, 1)
        g = q.shape[1] // hkv
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        qb = q[row : row + ql].transpose(0, 1)  # [Hq, ql, D]
        scores = qb @ k.transpose(1, 2) * batch.scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        p = torch.arange(L - ql, L)[:, None]
        j = torch.arange(L)[None, :]
        visible = (j <= p) & ((p - j < sliding_window) if sliding_window is not None else True)
        scores = scores.masked_fill(~visible, float("-inf"))
        out.append((F.softmax(scores, -1) @ v).transpose(0, 1))
        row += ql
    return torch.cat(out)


# (block_size, Hkv, G, D, lens, q_lens): decode rows (q_len 1), whole prompts, chunks after a prefix
BATCHES = [
    (4, 2, 3, 16, [1, 9, 23, 17], [1, 1, 1, 1]),
    (4, 1, 4, 16, [13, 23, 8, 30], [13, 7, 1, 4]),
    (8, 3, 1, 32, [40, 5, 19], [40, 5, 1]),
    (4, 2, 2, 16, [31, 26, 3, 11], [31, 1, 3, 6]),
    (4, 1, 2, 16, [100, 83], [100, 45]),  # long enough for several query tiles per sequence
]
WINDOWS = [1, 3, 4, 7, 8, 23, 64]  # 1 token, under/at/over a block, and over every context


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bs,hkv,g,d,lens,q_lens", BATCHES)
def test_references_match_dense_masked_attention(seed, bs, hkv, g, d, lens, q_lens, dtype, softcap):
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=bs, num_kv_heads=hkv, group=g, head_dim=d,
                             dtype=dtype, device="cpu", poison=0.0)
    batch.q.mul_(2.0)  # larger logits, so that a softcap of 3 bites
    for w in WINDOWS + [max(lens)]:  # ... and a window exactly the longest context
        want = dense_attention(batch, w, softcap)
        out = paged_attention_ref(*batch.args(), out=poisoned_like(batch.q), sliding_window=w, softcap=softcap)
        assert_close(out, want, dtype, f"paged_attention_ref W={w} lens={lens} q_lens={q_lens}")
        pre = paged_prefill_attention_ref(*batch.args(), sliding_window=w, softcap=softcap)
        assert_close(pre, want, dtype, f"prefill ref W={w}")
        if max(q_lens) == 1:
            dec = paged_decode_attention_ref(*batch.decode_args(), sliding_window=w, softcap=softcap)
            assert_close(dec, want, dtype, f"decode ref W={w}")


def test_dense_attention_and_oracle_agree_and_have_teeth(seed):
    """The two oracles agree; the window and the softcap each change the answer where they should
    (so a kernel ignoring either fails), and a window covering the context changes nothing."""
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=[20, 11], q_lens=[6, 1], block_size=4, num_kv_heads=1, group=2,
                             head_dim=16, dtype=torch.float64, device="cpu", poison=0.0)
    batch.q.mul_(3.0)
    for w, cap in [(5, None), (None, 2.0), (7, 2.0), (None, None)]:
        assert_close(oracle_attention(batch, w, cap), dense_attention(batch, w, cap), torch.float64, f"W={w} cap={cap}")
    plain = dense_attention(batch, None, None)
    assert (dense_attention(batch, 5, None) - plain).abs().max() > 1e-3
    assert (dense_attention(batch, None, 2.0) - plain).abs().max() > 1e-3
    assert torch.equal(dense_attention(batch, 20, None), plain)
    # window 1: each query sees only itself, so its output is its own value row
    own = dense_attention(batch, 1, None)
    t = batch.tables[1]
    assert torch.allclose(own[6], batch.v_cache[t[2], 2].repeat_interleave(2, 0))


def test_defaults_are_the_plain_results(seed):
    """Passing the options as None is bit-identical to not passing them."""
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=[20, 11, 7], q_lens=[6, 1, 7], block_size=4, num_kv_heads=2, group=2,
                             head_dim=16, dtype=torch.float32, device="cpu", poison=0.0)
    assert torch.equal(paged_attention_ref(*batch.args()),
                       paged_attention_ref(*batch.args(), sliding_window=None, softcap=None))


@pytest.mark.parametrize("window,cap", [(5, None), (5, 2.0), (None, 2.0), (64, 2.0)])
def test_reference_matches_transformers_attention(seed, window, cap):
    """transformers 5's own definitions: its sliding-window causal mask function and Gemma 2's eager
    attention (softcap, then the additive mask), on one whole prompt of a paged batch."""
    masking = pytest.importorskip("transformers.masking_utils")
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    gen = generator(seed)
    L, hkv, g = 19, 2, 2
    batch = make_paged_batch(gen, lens=[L], q_lens=[L], block_size=4, num_kv_heads=hkv, group=g, head_dim=16,
                             dtype=torch.float32, device="cpu", poison=0.0)
    batch.q.mul_(2.0)
    fn = masking.sliding_window_causal_mask_function(window) if window else masking.causal_mask_function
    zero = torch.tensor(0)
    allowed = torch.tensor([[bool(fn(zero, zero, torch.tensor(i), torch.tensor(j))) for j in range(L)] for i in range(L)])
    additive = torch.zeros(L, L).masked_fill(~allowed, float("-inf"))[None, None]
    table = batch.tables[0]
    k = torch.cat([batch.k_cache[b] for b in table])[:L].transpose(0, 1)[None]  # [1, Hkv, L, D]
    v = torch.cat([batch.v_cache[b] for b in table])[:L].transpose(0, 1)[None]
    module = torch.nn.Module().eval()
    module.num_key_value_groups = g
    want, _ = eager_attention_forward(module, batch.q.transpose(0, 1)[None], k, v, additive, scaling=batch.scale,
                                      softcap=cap)
    out = paged_prefill_attention_ref(*batch.args(), sliding_window=window, softcap=cap)
    assert_close(out, want[0], torch.float32, f"vs transformers W={window} cap={cap}")
