"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Weights are plain tensors; q/k/v and gate/up projections are fused into one matmul each, because
on every device a few large matmuls beat many small ones. Only the rows that need logits go
through the final norm and the LM head.

Every projection is stored as the right operand of ``x @ w`` (``[in, out]``). On CPU that layout is
materialised: for the 8-64-row inputs of decode steps the CPU sgemm is 2-4x faster with a
row-major ``[in, out]`` operand than with the transposed ``[out, in]`` view ``F.linear`` passes
(this model, 2-core AVX-512 VM: 106 ms vs 30 ms for one batch-16 pass over the 30 layers; the
same at 96+ rows). On CUDA it stays a transposed view, which cuBLAS takes as is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

import kernels
from qworker.model.attention import AttentionMetadata, PagedAttention
from qworker.model.rope import RotaryEmbedding


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class LlamaModel:
    """``kernel_backend``: "triton" (the default on CUDA) or "cpu" (the default on CPU: the C kernels
    with torch references). Tests run the Triton backend on CPU tensors under the interpreter."""

    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype, max_positions: int, kernel_backend: str | None = None):
        backend = kernel_backend or ("triton" if device.type == "cuda" else "cpu")
        if backend not in ("triton", "cpu"):
            raise ValueError(f"kernel_backend must be 'triton' or 'cpu', got {backend!r}")
        self.config = config
        self.device = device
        self.dtype = dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = config.num_hidden_layers
        self.eps = config.rms_norm_eps
        self.vocab_size = config.vocab_size
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

        self.embed = weights.pop("model.embed_tokens.weight")
        self.norm = weights.pop("model.norm.weight")
        lm_head = weights.pop("lm_head.weight", None)
        lm_head = self.embed if lm_head is None or getattr(config, "tie_word_embeddings", False) else lm_head
        # a tied head gets its own [in, out] copy on CPU; the embedding keeps its rows for lookups
        self.lm_head = _right_operand(lm_head, device)
        self.layers = [self._take_layer(weights, i, device) for i in range(self.num_layers)]
        self.rope = RotaryEmbedding(config, self.head_dim, max_positions, device, dtype, backend)
        self.attn = PagedAttention(backend, scale=self.head_dim**-0.5)
        triton = backend == "triton"
        # fused residual-add + RMSNorm: the Triton kernel, or the C kernel on CPU
        self.norm_fn = kernels.rms_norm if triton else kernels.rms_norm_cpu
        self.swiglu = kernels.silu_and_mul_ref if triton else kernels.silu_and_mul_cpu

    @staticmethod
    def _take_layer(w: dict[str, torch.Tensor], i: int, device: torch.device) -> LayerWeights:
        p = f"model.layers.{i}."
        q, k, v = (w.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv")
        biases = [w.pop(f"{p}self_attn.{n}_proj.bias", None) for n in "qkv"]
        return LayerWeights(
            input_norm=w.pop(f"{p}input_layernorm.weight"),
            qkv=_right_operand(torch.cat([q, k, v]), device),
            qkv_bias=torch.cat(biases) if biases[0] is not None else None,
            o=_right_operand(w.pop(f"{p}self_attn.o_proj.weight"), device),
            post_norm=w.pop(f"{p}post_attention_layernorm.weight"),
            gate_up=_right_operand(torch.cat([w.pop(f"{p}mlp.gate_proj.weight"), w.pop(f"{p}mlp.up_proj.weight")]), device),
            down=_right_operand(w.pop(f"{p}mlp.down_proj.weight"), device),
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # rows whose next-token logits are wanted
    ) -> torch.Tensor:
        norm = self.norm_fn
        h = F.embedding(input_ids, self.embed)
        T = h.shape[0]
        residual = None  # the running sum of the residual stream; h is the latest branch output
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = norm(h, layer.input_norm, self.eps, residual)
            qkv = x @ layer.qkv
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.reshape(T, self.num_kv_heads, self.head_dim)
            self.rope(positions, q, k)  # in place, in the qkv buffer
            attn = self.attn(q, k, v, k_cache, v_cache, meta)
            h = attn.reshape(T, self.q_size) @ layer.o
            x, residual = norm(h, layer.post_norm, self.eps, residual)
            h = self.swiglu(x @ layer.gate_up) @ layer.down
        x, _ = norm(h[logits_indices], self.norm, self.eps, residual[logits_indices])
        return (x @ self.lm_head).float()


def _right_operand(weight: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``weight`` ([out, in], as checkpoints store it) as the ``[in, out]`` operand of ``x @ w``:
    contiguous on CPU (see the module docstring), a free transposed view on CUDA."""
    return weight.t() if device.type == "cuda" else weight.t().contiguous()
