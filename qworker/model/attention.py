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
