"""Plain-torch references for the paged-KV kernels.

These are not only test oracles: the engine runs them in production on CPU,
so they are written to be fast there (batched gathers, one SDPA/matmul per
batch or per sequence, no per-token Python loops).

Layout shared by every function in this package
------------------------------------------------
* KV cache, per layer: ``k_cache`` and ``v_cache`` of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]``.
* A *slot* is the flat position of one token in that cache:
  ``slot = block_id * block_size + offset``; ``k_cache.view(-1, Hkv, D)[slot]``
  is that token's key.
* ``block_tables[b, i]`` (int32) is the block holding tokens
  ``[i * block_size, (i + 1) * block_size)`` of sequence ``b``. Entries past
  ``cdiv(seq_lens[b], block_size)`` are padding with arbitrary values and are
  never dereferenced.
* GQA: ``Hq = Hkv * G``; query head ``h`` reads kv head ``h // G``.
* All softmax arithmetic is fp32 (or fp64 for fp64 inputs); outputs have the
  dtype of ``q``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "store_kv_ref",
    "paged_decode_attention_ref",
    "paged_prefill_attention_ref",
    "paged_attention_ref",
    "rms_norm_ref",
    "rotary_embedding_ref",
    "silu_and_mul_ref",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key[t]``/``value[t]`` (``[T, Hkv, D]``) to slot ``slot_mapping[t]``.

    A negative slot marks a padding token and is skipped. In place; values are
    cast to the cache dtype. The cache must be contiguous over its first two
    dims (it is, as allocated by the engine) so that it can be viewed by slot.
    """
    slots = slot_mapping.to(torch.long)
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() == 0:
        return
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def _gather_seq_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int
) -> torch.Tensor:
    """Gather ``[B, num_blocks * block_size, Hkv, D]`` through the block table.

    Padding entries of the table (past each sequence's last used block) are
    replaced by block 0 before indexing: they may hold any value, even out of
    range, and the positions they cover are masked out by the caller anyway.
    """
    bs = cache.shape[1]
    table = block_tables[:, :num_blocks].to(torch.long)
    used = (seq_lens.to(torch.long) + bs - 1) // bs
    col = torch.arange(num_blocks, device=table.device)
    table = torch.where(col[None, :] < used[:, None], table, torch.zeros_like(table))
    kv = cache[table]  # [B, nb, bs, Hkv, D]: one index op for the whole batch
    return kv.view(table.shape[0], num_blocks * bs, *cache.shape[2:])


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence (position ``seq_lens[b] - 1``) over its whole context.

    Batched: one index op gathers the live blocks of every sequence into
    ``[B, L, Hkv, D]`` (L = the longest context rounded up to whole blocks),
    then one SDPA call with a length mask and ``enable_gqa`` (K/V are not
    repeated per query head). On CPU this beat grouped matmuls ~2x.
    Masked positions are multiplied by probability 0, so stale slots (tails
    of last blocks, block 0 standing in for table padding) must hold finite
    values: allocate the cache with ``torch.zeros``. ``num_splits`` is accepted
    for signature parity with the kernel and ignored.
    """
    del num_splits
    B, Hq, D = q.shape
    bs = k_cache.shape[1]
    lens = seq_lens.to(torch.long)
    # Only gather as many columns as the longest live sequence needs.
    nb = _cdiv(int(lens.max()), bs) if B else 0
    k = _gather_seq_kv(k_cache, block_tables, lens, nb).transpose(1, 2)  # [B, Hkv, L, D]
    v = _gather_seq_kv(v_cache, block_tables, lens, nb).transpose(1, 2)
    live = torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None]  # [B, L]
    acc = _acc_dtype(q.dtype)
    res = F.scaled_dot_product_attention(
        q.to(acc)[:, :, None, :], k.to(acc), v.to(acc),
        attn_mask=live[:, None, None, :], scale=scale, enable_gqa=True,
    )[:, :, 0, :]
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out


def _causal_mask(q_len: int, ctx: int, device: torch.device) -> torch.Tensor:
    """``[q_len, ctx]`` bool, True = attend. Query row i sits at position ctx - q_len + i."""
    prefix = ctx - q_len
    rows = torch.arange(q_len, device=device)[:, None] + prefix
    cols = torch.arange(ctx, device=device)[None, :]
    return cols <= rows


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention of each sequence's new queries over its cached context.

    Sequence b owns query rows ``q[query_start_loc[b]:query_start_loc[b+1]]``;
    they are the last ``q_len`` of its ``seq_lens[b]`` tokens, whose K/V
    (prefix and chunk alike) are already in the cache. Rows with ``q_len == 1``
    (decode rows of a mixed batch) go through the batched decode reference in
    one call; the others loop over sequences with one SDPA call each.
    """
    del max_query_len
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    bs = k_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    B = len(lens)
    qlens = [starts[b + 1] - starts[b] for b in range(B)]

    single = [b for b in range(B) if qlens[b] == 1]
    if single:
        idx = torch.tensor(single, device=q.device, dtype=torch.long)
        rows = query_start_loc.to(torch.long)[idx]
        res = paged_decode_attention_ref(q[rows], k_cache, v_cache, block_tables[idx], seq_lens[idx], scale)
        out[rows] = res.to(out.dtype)

    acc = _acc_dtype(q.dtype)
    for b in range(B):
        ql, ctx = qlens[b], lens[b]
        if ql <= 1:
            continue
        table = block_tables[b, : _cdiv(ctx, bs)].to(torch.long)
        k = k_cache[table].reshape(-1, Hkv, D)[:ctx]  # [ctx, Hkv, D]
        v = v_cache[table].reshape(-1, Hkv, D)[:ctx]
        qb = q[starts[b] : starts[b + 1]].transpose(0, 1).to(acc)  # [Hq, ql, D]
        kb = k.transpose(0, 1).to(acc)
        vb = v.transpose(0, 1).to(acc)
        if ql == ctx:  # no cached prefix: plain causal, SDPA's fast path
            res = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = _causal_mask(ql, ctx, q.device)
            res = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        out[starts[b] : starts[b + 1]] = res.transpose(0, 1).to(out.dtype)
    return out


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Route a step's attention: a pure-decode batch (``max_query_len == 1``) to the
    decode reference, anything else to the prefill reference."""
    if max_query_len == 1:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, out=out)
    return paged_prefill_attention_ref(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len, out=out
    )


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, optionally after adding a residual.

    Returns ``(out, new_residual)`` where ``new_residual = x + residual`` (or
    ``x`` itself when ``residual`` is None). The rounding order follows HF
    Llama: the sum is rounded to the input dtype, the norm is computed in fp32
    from that rounded sum, cast back, then multiplied by the weight.
    """
    h = x if residual is None else x + residual
    hf = h.to(_acc_dtype(h.dtype))
    var = hf.pow(2).mean(-1, keepdim=True)
    normed = (hf * torch.rsqrt(var + eps)).to(h.dtype)
    return weight * normed, h


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotary position embedding, rotate-half convention (as HF Llama), in place on
    ``q [T, Hq, D]`` and ``k [T, Hk, D]``. ``cos``/``sin`` are ``[max_positions, D]`` tables
    (both halves equal, any attention scaling folded in); token t uses row ``positions[t]``."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        x.copy_(x * c + rotated * s)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a fused gate/up projection ``[..., 2I]``: ``silu(gate) * up`` -> ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
