"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Weights are plain tensors; q/k/v and gate/up projections are fused into one matmul each, because
on every device a few large matmuls beat many small ones. Only the rows that need logits go
through the final norm and the LM head.

Every projection is a :class:`~qworker.model.linear.Linear`: on CUDA ``x @ w`` with ``w`` the
checkpoint's weight as a free transposed view (cuBLAS takes it as is); on CPU oneDNN with the
weight packed once at load, or ``x @ w`` with a row-major ``[in, out]`` copy where oneDNN is
unavailable or slower (chosen at start-up, see :mod:`qworker.model.linear`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

import kernels
from qworker.model.attention import AttentionMetadata, PagedAttention
from qworker.model.linear import Linear, cpu_linear_backend
from qworker.model.rope import RotaryEmbedding


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # q, k, v fused (with their biases, Qwen2)
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear  # gate and up fused
    down: Linear


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

        # CPU bf16: bf16 weights and GEMMs (oneDNN, fp32 accumulation), fp32 activations between
        # them (norms, rotary, attention and the residual stream in fp32, as the C kernels want)
        self.act_dtype = torch.float32 if device.type == "cpu" and dtype == torch.bfloat16 else dtype
        act = self.act_dtype
        embed = weights.pop("model.embed_tokens.weight")
        self.embed = embed.to(act)  # the lookup table
        self.norm = weights.pop("model.norm.weight").to(act)
        lm_head = weights.pop("lm_head.weight", None)
        lm_head = embed if lm_head is None or getattr(config, "tie_word_embeddings", False) else lm_head
        raw = [self._take_layer(weights, i) for i in range(self.num_layers)]
        if device.type == "cuda":
            self.linear_backend = "transposed"
        else:
            # a few layers' projections are enough for the start-up timing (and more than the cache)
            sample = [w for layer in raw[:2] for w in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"])]
            self.linear_backend = cpu_linear_backend(dtype, sample)
        # a tied head gets its own copy in the GEMM layout; the embedding keeps its rows for lookups
        self.lm_head = Linear(lm_head, None, self.linear_backend, act)
        del embed, lm_head
        self.layers = []
        for layer in raw:
            self.layers.append(LayerWeights(
                input_norm=layer["input_norm"].to(act),
                qkv=Linear(layer["qkv"], layer["qkv_bias"], self.linear_backend, act),
                o=Linear(layer["o"], None, self.linear_backend, act),
                post_norm=layer["post_norm"].to(act),
                gate_up=Linear(layer["gate_up"], None, self.linear_backend, act),
                down=Linear(layer["down"], None, self.linear_backend, act),
            ))
            layer.clear()  # the [out, in] originals go as each layer is converted
        self.rope = RotaryEmbedding(config, self.head_dim, max_positions, device, act, backend)
        self.attn = PagedAttention(backend, scale=self.head_dim**-0.5)
        triton = backend == "triton"
        # fused residual-add + RMSNorm: the Triton kernel, or the C kernel on CPU
        self.norm_fn = kernels.rms_norm if triton else kernels.rms_norm_cpu
        self.swiglu = kernels.silu_and_mul_ref if triton else kernels.silu_and_mul_cpu

    @staticmethod
    def _take_layer(w: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor | None]:
        """Layer ``i``'s tensors, projections fused and still ``[out, in]``."""
        p = f"model.layers.{i}."
        q, k, v = (w.pop(f"{p}self_attn.{n}_proj.weight") for n in "qkv")
        biases = [w.pop(f"{p}self_attn.{n}_proj.bias", None) for n in "qkv"]
        return {
            "input_norm": w.pop(f"{p}input_layernorm.weight"),
            "qkv": torch.cat([q, k, v]),
            "qkv_bias": torch.cat(biases) if biases[0] is not None else None,
            "o": w.pop(f"{p}self_attn.o_proj.weight"),
            "post_norm": w.pop(f"{p}post_attention_layernorm.weight"),
            "gate_up": torch.cat([w.pop(f"{p}mlp.gate_proj.weight"), w.pop(f"{p}mlp.up_proj.weight")]),
            "down": w.pop(f"{p}mlp.down_proj.weight"),
        }

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
            qkv = layer.qkv(x)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.reshape(T, self.num_kv_heads, self.head_dim)
            self.rope(positions, q, k)  # in place, in the qkv buffer
            attn = self.attn(q, k, v, k_cache, v_cache, meta)
            h = layer.o(attn.reshape(T, self.q_size))
            x, residual = norm(h, layer.post_norm, self.eps, residual)
            h = layer.down(self.swiglu(layer.gate_up(x)))
        x, _ = norm(h[logits_indices], self.norm, self.eps, residual[logits_indices])
        return self.lm_head(x).float()

