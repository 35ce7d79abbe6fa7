"""One attention interface over the paged KV cache: the Triton kernels on CUDA; on CPU the C decode
and extend kernels (all from the top-level ``kernels`` package, same signatures)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs shared by every layer. Sequences are ordered decodes first: the first
    ``num_decodes`` sequences have one query token each (rows ``[0, num_decodes)``)."""

    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    max_query_len: int
    num_decodes: int


def chunked_metadata(meta: AttentionMetadata, chunk: int, block_size: int) -> AttentionMetadata:
    """``meta``'s queries under local attention in chunks of ``chunk`` tokens (Llama 4's rotary
    layers): a query at position ``p`` sees the keys from ``floor(p / chunk) * chunk`` to ``p``.

    No kernel changes: each sequence's queries are cut where they cross a chunk boundary into
    virtual sequences whose context starts at their chunk's first token, their block-table rows
    starting at that token's block (``chunk`` is a multiple of ``block_size``). A decode row stays
    one sequence, so decodes still come first. ``slot_mapping`` is unchanged: k and v are stored
    where they always are, and the cache is shared with the layers that attend to everything."""
    if chunk < 1 or chunk % block_size:
        raise ValueError(f"attention chunks of {chunk} tokens need blocks that divide them, got block_size={block_size}")
    seq_lens, starts = meta.seq_lens.tolist(), meta.query_start_loc.tolist()
    rows, offsets, lens, query_start = [], [], [], [0]
    for b, (end, q0, q1) in enumerate(zip(seq_lens, starts, starts[1:])):
        p = end - (q1 - q0)  # the sequence's first query position
        while p < end:
            c0 = p // chunk * chunk
            stop = min(end, c0 + chunk)
            rows.append(b)
            offsets.append(c0 // block_size)
            lens.append(stop - c0)
            query_start.append(query_start[-1] + stop - p)
            p = stop
    dev, width = meta.block_tables.device, meta.block_tables.shape[1]
    # row r's table from its chunk's first block on; entries past its length are never read
    index = (torch.arange(width, device=dev)[None, :] + torch.tensor(offsets, device=dev)[:, None]).clamp_(max=width - 1)
    tables = meta.block_tables[torch.tensor(rows, device=dev)].gather(1, index)
    return AttentionMetadata(slot_mapping=meta.slot_mapping, block_tables=tables,
                             query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
                             seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
                             max_query_len=max(b - a for a, b in zip(query_start, query_start[1:])), num_decodes=meta.num_decodes)


class PagedAttention:
    def __init__(self, backend: str, scale: float, sliding_window: int | None = None, softcap: float | None = None,
                 bf16_products: bool = False, sinks: torch.Tensor | None = None):
        """``backend``: "triton" (CUDA) or "cpu" (the C decode/extend/store kernels; each falls back to
        its torch reference for inputs it does not cover).

        ``sliding_window``: a query at position p attends keys ``p - sliding_window < j <= p``;
        ``softcap``: scores become ``softcap * tanh(score / softcap)`` (Gemma 2). Both are per
        layer kind and passed to every kernel call; None (the default) is plain causal attention.
        ``bf16_products`` (CPU, the bf16 mode): attention over a bf16 cache multiplies in bf16,
        prefill on AMX and decode with AVX512_BF16 dot products where the CPU has them
        (:func:`kernels.cpu.paged_prefill_attention_cpu`, :func:`kernels.cpu.paged_decode_attention_cpu`).
        ``sinks`` (fp32 ``[Hq]``, gpt-oss): one more logit per query head in its softmax, with no
        value (a layer's own: such a layer has an attention object of its own).
        """
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be > 0 or None, got {softcap}")
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        # only non-default options are passed, so the plain calls stay exactly as before
        self.sinks = sinks
        self._opts = {k: v for k, v in (("sliding_window", sliding_window), ("softcap", softcap), ("sinks", sinks)) if v is not None}
        triton = backend == "triton"
        # the CPU bf16 mode: both kernels' products in bf16 where the CPU can (kernels.cpu)
        self.bf16_products = bf16_products and not triton
        self._prefill_opts = self._decode_opts = {**self._opts, "bf16_products": True} if self.bf16_products else self._opts
        self._store = kernels.store_kv if triton else kernels.store_kv_cpu
        self._decode = kernels.paged_decode_attention if triton else kernels.paged_decode_attention_cpu
        self._prefill = kernels.paged_prefill_attention if triton else kernels.paged_prefill_attention_cpu

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        nd = meta.num_decodes
        num_seqs = meta.seq_lens.shape[0]
        if nd == num_seqs:
            return self._decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale, **self._decode_opts)
        if nd == 0:
            return self._prefill(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, self.scale,
                meta.max_query_len, **self._prefill_opts,
            )
        out = torch.empty_like(q)
        self._decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], self.scale, out=out[:nd],
                     **self._decode_opts)
        self._prefill(
            q[nd:],
            k_cache,
            v_cache,
            meta.block_tables[nd:],
            meta.query_start_loc[nd:] - nd,
            meta.seq_lens[nd:],
            self.scale,
            meta.max_query_len,
            out=out[nd:],
            **self._prefill_opts,
        )
        return out
