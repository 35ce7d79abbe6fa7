"""Model runner: turns a ``Batch`` into tensors, applies the block moves, runs the forward pass.

It owns the weights and the KV tensors and knows nothing of scheduling.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from qworker.model.attention import AttentionMetadata
from qworker.model.batch import Batch
from qworker.model.kv_cache import KVCache, bytes_per_block
from qworker.model.linear import check_cpu_bf16
from qworker.model.llama import LlamaModel
from qworker.model.loader import load_config, load_state_dict, resolve_device, resolve_dtype


class ModelRunner:
    def __init__(self, model_dir: str | Path, device: str = "auto", dtype: str = "auto", max_model_len: int | None = None,
                 kv_cache_dtype: str = "auto", kernel_backend: str | None = None):
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
        self.max_model_len = min(max_model_len or model_len, model_len)
        weights = load_state_dict(model_dir, self.device, self.dtype)
        self.model = LlamaModel(self.config, weights, self.device, self.dtype, self.max_model_len, kernel_backend)
        self.kv: KVCache | None = None
        self.block_size = 0

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
        self.block_size = block_size
        self.kv = KVCache(m.num_layers, num_blocks, num_cpu_blocks, block_size, m.num_kv_heads, m.head_dim, self.device, self.kv_dtype)

    def execute(self, batch: Batch) -> torch.Tensor:
        """Runs one step; returns fp32 logits, one row per chunk with ``needs_logits``, in order."""
        assert self.kv is not None
        self.kv.apply(batch.swap_out, batch.swap_in, batch.copy)
        input_ids, positions, meta, logits_indices = self._prepare(batch)
        return self.model.forward(input_ids, positions, self.kv.layers, meta, logits_indices)

    def _prepare(self, batch: Batch):
        bs = self.block_size
        chunks = batch.chunks
        num_decodes = 0
        for c in chunks:
            if len(c.token_ids) != 1:
                break
            num_decodes += 1
        input_ids = list(itertools.chain.from_iterable(c.token_ids for c in chunks))
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens = []
        logits_indices = []
        for c in chunks:
            end = c.start_pos + len(c.token_ids)
            pos = range(c.start_pos, end)
            positions.extend(pos)
            slots.extend(c.block_ids[p // bs] * bs + p % bs for p in pos)
            query_start.append(query_start[-1] + len(c.token_ids))
            seq_lens.append(end)
            if c.needs_logits:
                logits_indices.append(query_start[-1] - 1)
        max_blocks = max(len(c.block_ids) for c in chunks)
        tables = [c.block_ids + [0] * (max_blocks - len(c.block_ids)) for c in chunks]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            max_query_len=max(len(c.token_ids) for c in chunks),
            num_decodes=num_decodes,
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(logits_indices, dtype=torch.long, device=dev),
        )
