"""Triton paged decode attention (flash-decoding), reading KV pages in place.

Shapes and layout are those of :mod:`kernels.reference`. One query token per
sequence, at position ``seq_lens[b] - 1``; its own K/V are already stored.

Work split
----------
Stage 1 runs one program per ``(sequence b, kv head, split s)``. The program
loads the ``G`` query heads that share that kv head as the rows of one
``[G_PAD, D]`` tile, so each K/V element is read from memory once for the
whole group (GQA without repeating K/V). Split ``s`` covers context positions
``[s * split_size, min((s + 1) * split_size, seq_len))``; ``split_size`` is a
multiple of ``BLOCK_N`` and the same for every sequence of the launch. A split
that starts at or past ``seq_len`` is *empty*: it writes ``lse = -inf`` and a
zero partial output, and the reduction ignores it. Tiles of ``BLOCK_N``
positions look their page up per position (``block_tables[b, pos //
block_size]``), so ``BLOCK_N`` and the page size are independent and padding
entries of the table are never read.

Stage 1 stores, per (b, query head, split), the split's normalized output and
its log-sum-exp (base 2). Stage 2, one program per (b, query head), merges
the non-empty splits: ``out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)``.
With a single split stage 1 writes the final output and stage 2 is skipped.

Sliding window (``HAS_WINDOW``): the query at ``seq_len - 1`` sees positions
``[lo, seq_len)``, ``lo = max(0, seq_len - window)``. Splits are laid out from
``lo`` instead of 0 (split ``s`` covers ``[lo + s * split_size, ...)``) and the
split size is derived from ``min(max_ctx, window)``, so pages before the window
are never read and no program is spent on them; every position a tile visits
is inside the window, so no per-position window mask is needed.

Soft-capping (``HAS_SOFTCAP``): ``qk_scale`` is then ``scale / softcap`` and
the base-2 score is ``tanh(q.k * qk_scale) * softcap * log2(e)``.

Invariant that keeps the online softmax NaN-free: every tile a program visits
holds at least one live position (tiles start inside ``[start, end)``), so the
running max is finite after the first tile; masked scores are ``-inf`` and
contribute exp2(-inf) = 0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .contracts import check_block_tables, check_cache, check_out, check_vector

_LOG2E = 1.4426950408889634
MAX_SPLITS = 64


@triton.jit
def _tanh(x):
    """tanh from one exp of a non-positive argument: no overflow for any x."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr,
    part_out_ptr, part_lse_ptr, out_ptr,
    sinks_ptr,  # fp32 [HQ] attention sinks; unused without HAS_SINKS
    qk_scale,  # softmax scale * log2(e): scores live in base 2 (scale / softcap with HAS_SOFTCAP)
    cap_log2e,  # softcap * log2(e); unused without HAS_SOFTCAP
    window,  # sliding window in positions; unused without HAS_WINDOW
    split_size,
    stride_qb, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_btb,
    stride_ob, stride_oh,
    HQ: tl.constexpr, NUM_SPLITS: tl.constexpr,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the final output, no stage 2
    DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    s = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = s * split_size
    if HAS_WINDOW:
        start += tl.maximum(seq_len - window, 0)
    end = tl.minimum(start + split_size, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kh * G + offs_g
    g_mask = offs_g < G
    d_mask = offs_d < D
    gd_mask = g_mask[:, None] & d_mask[None, :]

    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=gd_mask, other=0.0,
    )
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        page = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = page * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kh * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [G_PAD, BLOCK_N]
        if HAS_SOFTCAP:
            scores = _tanh(scores) * cap_log2e
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    live = l_i > 0  # False only for an empty split
    l_safe = tl.where(live, l_i, 1.0)
    if DIRECT and HAS_SINKS:  # one more logit per head, with no value (the split path adds it in stage 2)
        sink = tl.load(sinks_ptr + heads, mask=g_mask, other=float("-inf")) * 1.4426950408889634
        l_safe = tl.where(live, l_i + tl.exp2(sink - m_i), 1.0)
    o = acc / l_safe[:, None]
    if DIRECT:
        out_rows = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
        tl.store(out_rows + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=gd_mask)
    else:
        # part_out is contiguous [B, HQ, NUM_SPLITS, D]; part_lse [B, HQ, NUM_SPLITS].
        part = (b.to(tl.int64) * HQ + heads) * NUM_SPLITS + s
        tl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], o, mask=gd_mask)
        lse = tl.where(live, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr,
    sinks_ptr,  # fp32 [HQ] attention sinks; unused without HAS_SINKS
    window,
    split_size,
    stride_ob, stride_oh,
    HQ: tl.constexpr, NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    span = seq_len  # positions attended, laid out over the splits from the first one
    if HAS_WINDOW:
        span = tl.minimum(seq_len, window)
    n_live = tl.cdiv(span, split_size)  # splits past this one are empty: never read them
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = (offs_s < n_live) & (offs_s < NUM_SPLITS)
    d_mask = offs_d < D
    base = (b.to(tl.int64) * HQ + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + base, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no live split (seq_len 0): all weights 0, no NaN
    w = tl.exp2(lse - m)
    o = tl.load(part_out_ptr + base[:, None] * D + offs_d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(w, 0)
    if HAS_SINKS:  # the sink's logit (base 2) joins the denominator only
        total += tl.exp2(tl.load(sinks_ptr + h) * 1.4426950408889634 - m)
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)  # zeros, as one split writes
    dst = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(dst, res.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_num_splits(batch: int, num_kv_heads: int, max_ctx: int, block_n: int, device: torch.device) -> int:
    """Splits per sequence so that ``batch * num_kv_heads * splits`` programs fill the GPU.

    ``max_ctx`` is an upper bound on the context (the block table's width times
    the page size: known on the host without a device sync). Aim for about four
    programs per SM, never fewer than one tile of ``block_n`` per split.
    """
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
    tiles = max(1, triton.cdiv(max_ctx, block_n))
    want = triton.cdiv(4 * sms, max(1, batch * num_kv_heads))
    return max(1, min(want, tiles, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`kernels.reference.paged_decode_attention_ref`.

    No host sync: the split size is derived from the block table's width (and
    the window), so the call can be captured in a CUDA graph. ``out``
    (``[B, Hq, D]``) may be given to write in place; ``block_n``/``num_warps``/
    ``num_stages`` are tuning knobs (positions per tile, launch config).
    """
    B, Hq, D = q.shape
    _, block_size, Hkv, Dc = k_cache.shape
    assert Dc == D and Hq % Hkv == 0, f"q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    check_cache(q, k_cache, v_cache)
    G = Hq // Hkv
    check_block_tables(block_tables, B)
    check_vector(seq_lens, "seq_lens", B)
    if out is None:
        out = torch.empty_like(q)
    check_out(out, q)
    if B == 0:
        return out
    max_ctx = max(1, block_tables.shape[1] * block_size)
    if sliding_window is not None:
        assert sliding_window >= 1, f"sliding_window {sliding_window}"
        max_ctx = min(max_ctx, sliding_window)  # positions one query can attend
    if num_splits is None:
        num_splits = choose_num_splits(B, Hkv, max_ctx, block_n, q.device)
    # Equal split sizes, rounded up to whole tiles; drop splits that no sequence can reach.
    split_size = triton.cdiv(triton.cdiv(max_ctx, num_splits), block_n) * block_n
    num_splits = max(1, min(num_splits, triton.cdiv(max_ctx, split_size)))
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused by the kernel
    else:
        part_out = torch.empty((B, Hq, num_splits, D), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    D_PAD = triton.next_power_of_2(D)
    if sinks is not None:
        check_vector(sinks, "sinks", Hq, torch.float32)
    _decode_split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        part_out, part_lse, out, sinks if sinks is not None else out,
        scale / softcap if softcap is not None else scale * _LOG2E,
        softcap * _LOG2E if softcap is not None else 0.0,
        sliding_window or 0, split_size,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        HQ=Hq, NUM_SPLITS=num_splits,
        G=G, G_PAD=max(16, triton.next_power_of_2(G)), D=D, D_PAD=D_PAD,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, DIRECT=direct,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if not direct:
        _decode_reduce_kernel[(B, Hq)](
            part_out, part_lse, seq_lens, out, sinks if sinks is not None else out,
            sliding_window or 0, split_size, out.stride(0), out.stride(1),
            HQ=Hq, NUM_SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits),
            D=D, D_PAD=D_PAD, HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
            num_warps=4 if D_PAD >= 128 else 2,
        )
    return out


__all__ = ["paged_decode_attention", "choose_num_splits", "MAX_SPLITS"]
