"""DeepSeek's multi-head latent attention (MLA) as the decoder's fused q/k/v projection.

The model compresses each token's keys and values into a latent (``kv_lora_rank`` channels) and
one rotated key part that all heads share; ``kv_b`` expands the latent into every head's
unrotated key channels and its value. This engine serves MLA by that expansion: each head's k and
v go into the paged KV cache like any other multi-head attention's (a head of ``rope + nope``
channels, see below), so every attention kernel, prefix sharing, swap and
recompute work unchanged. A head is ``max(rope + nope, v_dim)`` channels wide: the narrower of q/k
and v is padded with zeros (which add nothing to a score or an output). The cost is KV memory: the
expanded heads take ``2 * heads * head_dim`` values a token and layer where the latent would take ``kv_lora_rank + rope`` (about 10x
more for DeepSeek-V2-Lite). Caching the latent itself needs attention kernels that read it (the
absorbed form); not built.

:class:`LatentQKV` returns the buffer the decoder's plain projection would: ``[T, 3 * H * D]``,
all q heads, then all k heads, then all v heads, each head's rotated channels first (the rows of
``q_b`` and ``kv_a`` were reordered at load to put them there; q.k is the same sum in any
channel order). :class:`HeadPrefix` feeds ``o`` the first ``v_dim`` channels of each head.
"""

from __future__ import annotations

from typing import Callable

import torch

from qworker.model.linear import Linear

Norm = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class LatentQKV:
    """``x`` ``[T, hidden]`` -> ``[T, 3 * heads * head_dim]`` (see the module docstring)."""

    __slots__ = ("q_a", "q_a_norm", "q_b", "kv_a", "kv_a_norm", "kv_b", "heads", "head_dim", "rope", "nope", "v_dim", "norm", "eps")

    def __init__(self, q_a: Linear | None, q_a_norm: torch.Tensor | None, q_b: Linear, kv_a: Linear, kv_a_norm: torch.Tensor,
                 kv_b: Linear, heads: int, head_dim: int, rope: int, nope: int, v_dim: int, norm: Norm, eps: float):
        if head_dim != max(rope + nope, v_dim):
            raise ValueError(f"latent attention heads are max(rope + nope, v_dim) = {max(rope + nope, v_dim)} wide, got {head_dim}")
        self.q_a, self.q_a_norm, self.q_b = q_a, q_a_norm, q_b
        self.kv_a, self.kv_a_norm, self.kv_b = kv_a, kv_a_norm, kv_b
        self.heads, self.head_dim, self.rope, self.nope, self.v_dim = heads, head_dim, rope, nope, v_dim
        self.norm, self.eps = norm, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        T, H, R, D = x.shape[0], self.heads, self.rope, self.head_dim
        qk = R + self.nope
        q = self.q_b(x if self.q_a is None else self.norm(self.q_a(x), self.q_a_norm, self.eps)[0])
        ckv = self.kv_a(x)  # [T, latent + rope]
        latent = self.norm(ckv[:, :-R].contiguous(), self.kv_a_norm, self.eps)[0]
        kv = self.kv_b(latent).view(T, H, self.nope + self.v_dim)
        out = torch.empty((T, 3, H, D), dtype=q.dtype, device=q.device)
        out[:, 0, :, :qk] = q.view(T, H, qk)
        out[:, 1, :, :R] = ckv[:, None, -R:]  # the rotated key part, the same for every head
        out[:, 1, :, R:qk] = kv[..., :self.nope]
        out[:, :2, :, qk:] = 0
        out[:, 2, :, :self.v_dim] = kv[..., self.nope:]
        out[:, 2, :, self.v_dim:] = 0
        return out.view(T, 3 * H * D)


class HeadPrefix:
    """``o`` reading each head's first ``v_dim`` channels of the attention output ``[T, heads *
    head_dim]`` (the rest are the zeros v was padded with)."""

    __slots__ = ("o", "heads", "head_dim", "v_dim")

    def __init__(self, o: Linear, heads: int, head_dim: int, v_dim: int):
        self.o, self.heads, self.head_dim, self.v_dim = o, heads, head_dim, v_dim

    def __call__(self, attn: torch.Tensor) -> torch.Tensor:
        T = attn.shape[0]
        return self.o(attn.view(T, self.heads, self.head_dim)[..., :self.v_dim].reshape(T, self.heads * self.v_dim))
