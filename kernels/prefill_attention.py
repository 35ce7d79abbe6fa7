"""Triton paged prefill / extend attention: varlen, causal, KV read in place.

Shapes and layout are those of :mod:`kernels.reference`. Sequence ``b`` owns
query rows ``[query_start_loc[b], query_start_loc[b+1])``; they are the last
``q_len`` positions of its ``seq_len`` tokens, so query row ``i`` sits at
position ``prefix + i`` with ``prefix = seq_len - q_len`` (tokens from the
prefix cache or earlier chunks). All ``seq_len`` tokens' K/V are already in
the cache. Row ``i`` attends positions ``0 .. prefix + i``.

One program per ``(query tile of BLOCK_M rows, query head, sequence)``; it
walks the key positions ``[0, min(seq_len, prefix + last row + 1))`` in tiles
of ``BLOCK_N``, looking each position's page up in the block table. Tiles of
a sequence past its ``q_len`` run no loop and store nothing (the grid is sized
by ``max_query_len`` for the whole batch). The first key tile holds position 0,
which every row may attend, so the running max is finite from then on.
With a sliding window (``HAS_WINDOW``) row ``i`` attends only positions
``> prefix + i - window``: the key loop starts at the first row's first visible
position, so key tiles wholly before every row's window are never read. A row
may then see a tile with no visible key while its running max is still
``-inf``; the max is replaced by 0 for the exponentials (all of which are
``exp2(-inf) = 0``) so that no ``-inf - -inf`` NaN arises.

Soft-capping (``HAS_SOFTCAP``): ``qk_scale`` is ``scale / softcap`` and the
base-2 score is ``tanh(q.k * qk_scale) * softcap * log2(e)``.

Query heads of a GQA group each re-read their kv head's K/V (through L2);
prefill is compute-bound, so packing the group is left for later.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .contracts import check_block_tables, check_cache, check_out, check_vector
from .decode_attention import _tanh

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    sinks_ptr,  # fp32 [Hq] attention sinks; unused without HAS_SINKS
    qk_scale,
    cap_log2e,  # softcap * log2(e); unused without HAS_SOFTCAP
    window,  # unused without HAS_WINDOW
    stride_qt, stride_qh,
    stride_cb, stride_cs, stride_ch,
    stride_btb,
    stride_ot, stride_oh,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    mt = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    kh = h // G
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    rows = mt * BLOCK_M + offs_m
    row_mask = rows < q_len
    d_mask = offs_d < D
    q_pos = prefix + rows
    # Causal bound of this tile's last row; 0 (no loop) for a tile past q_len.
    kv_end = tl.where(mt * BLOCK_M < q_len, tl.minimum(seq_len, prefix + (mt + 1) * BLOCK_M), 0)
    kv_start = 0
    if HAS_WINDOW:  # the first row's first visible key
        kv_start = tl.maximum(prefix + mt * BLOCK_M - window + 1, 0)

    q_rows = (q_start + rows).to(tl.int64) * stride_qt + h * stride_qh
    md_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=md_mask, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    for n0 in range(kv_start, kv_end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < kv_end
        page = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_row = page * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kh * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        if HAS_SOFTCAP:
            scores = _tanh(scores) * cap_log2e
        keep = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(keep, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_use = m_new
        if HAS_WINDOW:
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(scores - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if HAS_SINKS:  # one more logit (base 2) per head, with no value: the denominator only
        l_i += tl.exp2(tl.load(sinks_ptr + h) * 1.4426950408889634 - m_i)
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_rows = (q_start + rows).to(tl.int64) * stride_ot + h * stride_oh
    tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=md_mask)


def paged_prefill_attention(
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
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`kernels.reference.paged_prefill_attention_ref`.

    ``max_query_len`` (a host int) sizes the grid, so there is no device sync.
    ``out`` (``[T, Hq, D]``) may be given to write in place.
    """
    T, Hq, D = q.shape
    _, block_size, Hkv, Dc = k_cache.shape
    assert Dc == D and Hq % Hkv == 0, f"q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    check_cache(q, k_cache, v_cache)
    B = query_start_loc.shape[0] - 1
    check_vector(query_start_loc, "query_start_loc", B + 1)
    check_vector(seq_lens, "seq_lens", B)
    check_block_tables(block_tables, B)
    if out is None:
        out = torch.empty_like(q)
    check_out(out, q)
    if T == 0 or B == 0 or max_query_len == 0:
        return out
    assert sliding_window is None or sliding_window >= 1, f"sliding_window {sliding_window}"
    if max_query_len <= 16:  # decode-heavy or small chunks: don't waste a 64-row tile
        block_m = min(block_m, 16)
    if sinks is not None:
        check_vector(sinks, "sinks", Hq, torch.float32)
    grid = (triton.cdiv(max_query_len, block_m), Hq, B)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, sinks if sinks is not None else out,
        scale / softcap if softcap is not None else scale * _LOG2E,
        softcap * _LOG2E if softcap is not None else 0.0,
        sliding_window or 0,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=Hq // Hkv, D=D, D_PAD=triton.next_power_of_2(D),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_WINDOW=sliding_window is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


__all__ = ["paged_prefill_attention"]
