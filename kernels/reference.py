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

Options shared by every attention function (keyword-only, off by default)
-------------------------------------------------------------------------
* ``sliding_window=W``: the query at position ``p`` attends keys ``j`` with
  ``p - W < j <= p`` (at most ``W`` keys, itself included), as transformers'
  sliding-window masks. Blocks wholly before the window are never read.
* ``softcap=c``: scores are ``c * tanh(q.k * scale / c)`` (Gemma 2), applied
  after scaling and before the mask and the softmax.
* ``sinks`` (fp32 ``[Hq]``): attention sinks (gpt-oss): each query head's softmax
  has one more logit, ``sinks[h]``, with no value, so the weights of the real
  keys sum to less than one.
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


# Under a sliding window W, prefill queries go in tiles of max(W, this) rows (see the prefill reference)
_WINDOW_Q_TILE = 32


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
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_blocks: int,
    first_block: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather ``[B, num_blocks * block_size, Hkv, D]`` through the block table.

    With ``first_block`` ([B] long), row b's column c is table column
    ``first_block[b] + c`` (a sliding window's live blocks only).
    Padding entries of the table (past each sequence's last used block) are
    replaced by block 0 before indexing: they may hold any value, even out of
    range, and the positions they cover are masked out by the caller anyway.
    """
    bs = cache.shape[1]
    used = (seq_lens.to(torch.long) + bs - 1) // bs
    col = torch.arange(num_blocks, device=block_tables.device)
    if first_block is None:
        table = block_tables[:, :num_blocks].to(torch.long)
    else:
        cols = first_block[:, None] + col[None, :]
        used = used - first_block
        safe = cols.clamp(max=max(0, block_tables.shape[1] - 1))
        table = torch.gather(block_tables.to(torch.long), 1, safe) if num_blocks else cols
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
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence (position ``seq_lens[b] - 1``) over its whole context
    (or its last ``sliding_window`` tokens: only the blocks holding them are gathered).

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
    acc = _acc_dtype(q.dtype)
    if sliding_window is None:
        # Only gather as many columns as the longest live sequence needs.
        nb = _cdiv(int(lens.max()), bs) if B else 0
        k = _gather_seq_kv(k_cache, block_tables, lens, nb).transpose(1, 2)  # [B, Hkv, L, D]
        v = _gather_seq_kv(v_cache, block_tables, lens, nb).transpose(1, 2)
        live = torch.arange(k.shape[2], device=q.device)[None, :] < lens[:, None]  # [B, L]
    else:
        # Gather from each sequence's first block inside its window: column c is position
        # first * bs + c; live positions are [len - W, len).
        lo = (lens - sliding_window).clamp(min=0)
        first = lo // bs
        nb = int(((lens + bs - 1) // bs - first).max()) if B else 0
        k = _gather_seq_kv(k_cache, block_tables, lens, nb, first).transpose(1, 2)
        v = _gather_seq_kv(v_cache, block_tables, lens, nb, first).transpose(1, 2)
        pos = first[:, None] * bs + torch.arange(k.shape[2], device=q.device)[None, :]
        live = (pos < lens[:, None]) & (pos >= lo[:, None])
    res = _attend(q.to(acc)[:, :, None, :], k.to(acc), v.to(acc), live[:, None, None, :], scale, softcap, sinks=sinks)[:, :, 0, :]
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
    softcap: float | None, is_causal: bool = False, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [..., Hq, M, D]`` over ``k``/``v`` ``[..., Hkv, L, D]`` (GQA: query head h reads kv
    head h // G) with a bool ``mask`` broadcastable to ``[..., Hq, M, L]`` (True = attend).
    Without a softcap or sinks this is one SDPA call; with either, the scores are materialised.
    Every query row must attend at least one key."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1) @ v
    sink = sinks.to(device=scores.device, dtype=scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v


def _causal_mask(
    q_len: int, ctx: int, device: torch.device, sliding_window: int | None = None, first: int = 0
) -> torch.Tensor:
    """``[q_len, ctx - first]`` bool, True = attend. Query row i sits at position ctx - q_len + i;
    column c is key position first + c. With a window, row p sees ``p - W < j <= p``."""
    prefix = ctx - q_len
    rows = torch.arange(q_len, device=device)[:, None] + prefix
    cols = torch.arange(first, ctx, device=device)[None, :]
    mask = cols <= rows
    if sliding_window is not None:
        mask &= cols > rows - sliding_window
    return mask


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
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention of each sequence's new queries over its cached context.

    Sequence b owns query rows ``q[query_start_loc[b]:query_start_loc[b+1]]``;
    they are the last ``q_len`` of its ``seq_lens[b]`` tokens, whose K/V
    (prefix and chunk alike) are already in the cache. Rows with ``q_len == 1``
    (decode rows of a mixed batch) go through the batched decode reference in
    one call; the others loop over sequences with one SDPA call each. With a
    window ``W`` a sequence's queries go in tiles of ``max(W, 32)`` rows, each
    over the blocks from the one holding its first row's first visible key to
    its last row: keys wholly outside a tile's windows are neither gathered nor
    scored (a long prompt costs ~2W keys per row instead of its length).
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
        res = paged_decode_attention_ref(q[rows], k_cache, v_cache, block_tables[idx], seq_lens[idx], scale,
                                         sliding_window=sliding_window, softcap=softcap, sinks=sinks)
        out[rows] = res.to(out.dtype)

    acc = _acc_dtype(q.dtype)
    for b in range(B):
        ql, ctx = qlens[b], lens[b]
        if ql <= 1:
            continue
        prefix = ctx - ql
        tile = ql if sliding_window is None else max(sliding_window, _WINDOW_Q_TILE)
        for i0 in range(0, ql, tile):
            i1 = min(ql, i0 + tile)
            hi = prefix + i1  # keys [first, hi) for query rows [i0, i1)
            # first key this tile's first row sees, rounded down to its block
            first_blk = 0 if sliding_window is None else max(0, prefix + i0 + 1 - sliding_window) // bs
            first = first_blk * bs
            table = block_tables[b, first_blk : _cdiv(hi, bs)].to(torch.long)
            k = k_cache[table].reshape(-1, Hkv, D)[: hi - first]  # [hi - first, Hkv, D]
            v = v_cache[table].reshape(-1, Hkv, D)[: hi - first]
            rows = slice(starts[b] + i0, starts[b] + i1)
            qb = q[rows].transpose(0, 1).to(acc)  # [Hq, i1 - i0, D]
            kb = k.transpose(0, 1).to(acc)
            vb = v.transpose(0, 1).to(acc)
            if ql == ctx and sliding_window is None:  # no cached prefix: plain causal, SDPA's fast path
                res = _attend(qb, kb, vb, None, scale, softcap, is_causal=True, sinks=sinks)
            else:
                mask = _causal_mask(i1 - i0, hi, q.device, sliding_window, first)
                res = _attend(qb, kb, vb, mask, scale, softcap, sinks=sinks)
            out[rows] = res.transpose(0, 1).to(out.dtype)
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
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Route a step's attention: a pure-decode batch (``max_query_len == 1``) to the
    decode reference, anything else to the prefill reference."""
    opts = dict(out=out, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    if max_query_len == 1:
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, **opts)
    return paged_prefill_attention_ref(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len, **opts
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
