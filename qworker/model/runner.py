"""Model runner: turns a ``Batch`` into tensors, applies the block moves, runs the forward pass.

It owns the weights and the KV tensors and knows nothing of scheduling.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch

from qworker.model.attention import AttentionMetadata
from qworker.model.batch import Batch
from qworker.model.kv_cache import KVCache, bytes_per_block
from qworker.model.linear import check_cpu_bf16
from qworker.model.decoder import DecoderModel
from qworker.model.loader import load_config, load_state_dict, resolve_device, resolve_dtype
from qworker.model.rope import exact_context

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model_dir: str | Path, device: str = "auto", dtype: str = "auto", max_model_len: int | None = None,
                 kv_cache_dtype: str = "auto", kernel_backend: str | None = None, tp=None):
        """``tp``: this process's :class:`~qworker.model.parallel.build.TPRank` under tensor
        parallelism (the model is then its rank's shard); None: the whole model."""
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            check_cpu_bf16()  # a clear error where bf16 GEMMs would be emulated
        self.kv_dtype = self.dtype if kv_cache_dtype == "auto" else resolve_dtype(kv_cache_dtype, self.device)
        if self.kv_dtype != self.dtype and self.device.type != "cpu":
            # the Triton kernels are only checked with a cache of the model's dtype
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is supported on CPU only; use 'auto' on {self.device}")
        self.config = load_config(model_dir)
        model_len = getattr(self.config, "max_position_embeddings", 4096)
        if isinstance(model_len, bool) or not isinstance(model_len, int) or model_len < 2:  # a prompt token and its answer
            raise ValueError(f"{model_dir}/config.json: max_position_embeddings must be a whole number >= 2, got {model_len!r}")
        exact = exact_context(self.config)  # past it a fixed rope table would serve other tokens
        model_len = min(model_len, exact) if exact else model_len
        if max_model_len and max_model_len > model_len:  # served, but shorter than asked: say so
            log.warning("max_model_len=%d is past what %s serves exactly (%d positions%s); using %d", max_model_len,
                        model_dir, model_len, ", longrope's short factors" if exact and exact == model_len else "", model_len)
        self.max_model_len = min(max_model_len or model_len, model_len)
        if tp is None:
            weights = load_state_dict(model_dir, self.device, self.dtype, self.config)
            self.model = DecoderModel(self.config, weights, self.device, self.dtype, self.max_model_len, kernel_backend)
        else:
            self.model = tp.build_model(model_dir, self.config, self.device, self.dtype, self.max_model_len, kernel_backend)
        self.kv: KVCache | None = None
        self.block_size = 0
        self.lora = None  # a qworker.model.lora.model.LoRAModel once enable_lora ran

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """Wraps the model's projections with ``max_loras`` device LoRA slots of rank up to
        ``max_rank`` (once, at start). Without it the forward is the plain one."""
        from qworker.model.lora.model import LoRAModel

        if self.lora is not None:
            raise RuntimeError("enable_lora was already called")
        self.lora = LoRAModel(self.model, max_loras, max_rank)

    def set_lora(self, slot: int, adapter) -> None:
        """Copies a :class:`~qworker.model.lora.adapter.LoRAAdapter` into device slot ``slot``
        (``None`` clears it); chunks with ``lora_slot == slot`` then run under it."""
        if self.lora is None:
            raise RuntimeError("set_lora needs enable_lora first")
        self.lora.set(slot, adapter)

    def block_bytes(self, block_size: int) -> int:
        m = self.model
        return bytes_per_block(m.num_layers, block_size, m.num_kv_heads, m.head_dim, self.kv_dtype)

    def device_kv_budget(self, kv_cache_memory: int | None, gpu_memory_utilization: float, cpu_default: int) -> int:
        if kv_cache_memory is not None:
            return kv_cache_memory
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_by_others = total - free
            # leave room for activations: a generous fixed slack on top of the utilisation cap
            return max(int(total * gpu_memory_utilization) - used_by_others - (1 << 30), 0)
        return cpu_default

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int, block_size: int) -> None:
        m = self.model
        chunk = getattr(m, "attention_chunk", None)
        if chunk and chunk % block_size:  # chunked_metadata starts each chunk's block table at a block
            raise ValueError(f"block_size={block_size} must divide {self.config.model_type}'s attention_chunk_size={chunk}")
        self.block_size = block_size
        self.kv = KVCache(m.num_layers, num_blocks, num_cpu_blocks, block_size, m.num_kv_heads, m.head_dim, self.device, self.kv_dtype)

    def execute(self, batch: Batch) -> torch.Tensor:
        """Runs one step; returns fp32 logits, in chunk order: one row per chunk with
        ``needs_logits``, ``1 + num_draft`` rows (one per position) for a verify chunk. An
        ``argmax_only`` chunk's row may come back as the one-hot log-distribution of its greedy
        token (0 there, -inf elsewhere; see ``DecoderModel._head``); when every row is
        ``argmax_only`` the logits may be the model's dtype (bf16), read only for their argmax, or
        just those argmaxes: the rows' greedy tokens, int64 ``[rows]`` (a 1-D tensor)."""
        assert self.kv is not None
        self.kv.apply(batch.swap_out, batch.swap_in, batch.copy)
        input_ids, positions, meta, logits_indices, argmax_rows = self._prepare(batch)
        self.model.reach_positions(max((c.start_pos + len(c.token_ids) for c in batch.chunks), default=0))
        if self.lora is None:
            return self.model.forward(input_ids, positions, self.kv.layers, meta, logits_indices, argmax_rows)
        chunks = batch.chunks
        with self.lora.step([len(c.token_ids) for c in chunks], [c.lora_slot for c in chunks]):
            return self.model.forward(input_ids, positions, self.kv.layers, meta, logits_indices, argmax_rows)

    def _prepare(self, batch: Batch):
        bs = self.block_size
        chunks = batch.chunks
        input_ids = list(itertools.chain.from_iterable(c.token_ids for c in chunks))
        positions: list[int] = []
        slots: list[int] = []
        # attention rows: a leading decode chunk is one per token (each a decode query over its
        # own causal prefix); any other chunk is one varlen prefill row
        query_start = [0]
        seq_lens = []
        tables_src: list[list[int]] = []
        logits_indices = []
        argmax_rows: list[bool] = []  # per logits row: only its greedy token is wanted
        num_decodes = 0
        leading = True
        for c in chunks:
            n = len(c.token_ids)
            end = c.start_pos + n
            pos = range(c.start_pos, end)
            positions.extend(pos)
            slots.extend(c.block_ids[p // bs] * bs + p % bs for p in pos)
            first = query_start[-1]
            if leading and c.decode:
                for i in range(n):
                    query_start.append(first + i + 1)
                    seq_lens.append(c.start_pos + i + 1)
                    tables_src.append(c.block_ids)
                num_decodes += n
            else:
                leading = False
                query_start.append(first + n)
                seq_lens.append(end)
                tables_src.append(c.block_ids)
            if c.num_draft:
                logits_indices.extend(range(first, first + n))
                argmax_rows.extend([False] * n)
            elif c.needs_logits:
                logits_indices.append(first + n - 1)
                argmax_rows.append(c.argmax_only)
        max_blocks = max(len(t) for t in tables_src)
        tables = [t + [0] * (max_blocks - len(t)) for t in tables_src]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(b - a for a, b in zip(query_start, query_start[1:])),
            num_decodes=num_decodes,
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(logits_indices, dtype=torch.long, device=dev),
            torch.tensor(argmax_rows, dtype=torch.bool) if any(argmax_rows) else None,
        )
