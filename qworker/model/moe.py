"""A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks ``top_k``
of ``E`` SwiGLU experts per token and the layer returns their outputs summed with the router's
weights (Qwen2-MoE adds a shared expert: :class:`SharedExpertMoE`).

Routing is in fp32 whatever the model dtype: ``softmax(x @ router.T)`` over the experts, the
``top_k`` largest probabilities (``torch.topk``: ties go to the lower expert id, as in
transformers), optionally divided by their sum (``renormalize``; Mixtral's softmax over its top-k
logits is the same thing, Qwen3-MoE and OLMoE do it iff ``norm_topk_prob``).

Two paths, chosen by ``kernel_backend``:

* ``"cpu"``: the step's ``T * top_k`` (token, expert) pairs are sorted by expert once, and each
  active expert runs its two GEMMs once on its gathered tokens through the model's
  :class:`~qworker.model.linear.Linear` backend (oneDNN packed weights where they win, one
  ``Linear`` per expert projection built at load), the SwiGLU in the C kernel between them; the
  weighted outputs are scatter-added back with ``index_add_``. A decode step of batch ``B`` thus
  runs ``min(E, B * top_k)`` small GEMM pairs instead of a per-token loop.
* ``"triton"``: the fused grouped GEMM of :func:`kernels.moe_experts` (:mod:`kernels.fused_moe`) over the stacked weights;
  experts with biases or gpt-oss's clamped SwiGLU take the grouped path above on the device.

gpt-oss: the router has a bias, the experts have biases, and the activation is the clamped
SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=l)``
(``clamped_swiglu=(alpha, l)``).

Rounding follows transformers' eager experts loop: each expert's output is multiplied by its fp32
routing weight (Mixtral), or by the weight rounded to the activation dtype first
(``weights_in_act_dtype``: Qwen3-MoE and OLMoE), and the products are added in ascending expert
order per token. In fp32 this matches transformers up to GEMM rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kernels
from qworker.model.linear import Linear


class MoE:
    """``moe(x)``: ``[T, H]`` -> ``[T, H]`` in ``act_dtype``."""

    def __init__(
        self,
        router: torch.Tensor,  # [E, H]: the checkpoint's gate/router weight, [out, in]
        gate_up: torch.Tensor,  # [E, 2I, H]: per expert the gate rows, then the up rows
        down: torch.Tensor,  # [E, H, I]
        top_k: int,
        renormalize: bool,
        linear_backend: str,
        act_dtype: torch.dtype,
        kernel_backend: str,
        *,
        weights_in_act_dtype: bool = False,
        router_bias: torch.Tensor | None = None,  # [E]
        gate_up_bias: torch.Tensor | None = None,  # [E, 2I]
        down_bias: torch.Tensor | None = None,  # [E, H]
        clamped_swiglu: tuple[float, float] | None = None,  # gpt-oss's (alpha, limit)
    ):
        E, two_i, H = gate_up.shape
        if router.shape != (E, H) or down.shape != (E, H, two_i // 2) or two_i % 2:
            raise ValueError(f"MoE weights disagree: router {tuple(router.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
        if not 1 <= top_k <= E:
            raise ValueError(f"top_k must be in 1..{E} (the number of experts), got {top_k}")
        if kernel_backend not in ("cpu", "triton"):
            raise ValueError(f"kernel_backend must be 'cpu' or 'triton', got {kernel_backend!r}")
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, two_i // 2
        self.top_k = top_k
        self.renormalize = renormalize
        self.act_dtype = act_dtype
        self.kernel_backend = kernel_backend
        self.weights_in_act_dtype = weights_in_act_dtype
        # fp32 [E, H] through F.linear, the very call transformers makes in fp32: the same logits to
        # the bit, so near-ties between experts are settled the same way
        self.router = router.float().contiguous()
        self.router_bias = None if router_bias is None else router_bias.float().contiguous()
        self.clamped_swiglu = clamped_swiglu
        # the fused Triton kernel runs plain SwiGLU experts without biases; others go through Linear
        self.fused = kernel_backend == "triton" and gate_up_bias is None and down_bias is None and clamped_swiglu is None
        if self.fused:
            # the fused kernel reads the stacked [out, in] weights by expert id
            self.gate_up_w = gate_up.contiguous()
            self.down_w = down.contiguous()
            self.gate_up = self.down = None
        else:
            def bias(b: torch.Tensor | None, e: int) -> torch.Tensor | None:
                return None if b is None else b[e].to(act_dtype)
            self.gate_up = [Linear(gate_up[e], bias(gate_up_bias, e), linear_backend, act_dtype) for e in range(E)]
            self.down = [Linear(down[e], bias(down_bias, e), linear_backend, act_dtype) for e in range(E)]
            self.gate_up_w = self.down_w = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights fp32 [T, K], topk_ids int64 [T, K])`` for ``x`` ``[T, H]``."""
        logits = F.linear(x.float(), self.router, self.router_bias)
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.fused:
            # the kernel computes in the weights' dtype (fp32 accumulation), as Linear does
            out = kernels.moe_experts(x.to(self.gate_up_w.dtype), self.gate_up_w, self.down_w, weights, ids,
                                      weights_in_act_dtype=self.weights_in_act_dtype)
            return out.to(self.act_dtype)
        return self._grouped(x, weights, ids)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each active expert's GEMMs once, on its tokens (the pairs sorted by expert, stable, so a
        token's contributions are added in ascending expert id)."""
        K = self.top_k
        flat = ids.reshape(-1)
        if self.weights_in_act_dtype:
            weights = weights.to(self.act_dtype)
        if flat.numel() == K:  # one token (a batch-1 decode step): its experts are the groups
            order = torch.argsort(flat, stable=True)
            experts = flat[order].tolist()
            counts = [1] * K
        else:
            order = torch.argsort(flat, stable=True)
            counts_t = torch.bincount(flat, minlength=self.num_experts)
            experts = counts_t.nonzero().flatten().tolist()
            counts = counts_t[experts].tolist()
        tokens = order // K
        xs = x.index_select(0, tokens)  # [T*K, H], grouped by expert
        ws = weights.reshape(-1, 1).index_select(0, order)
        ys = torch.empty((flat.numel(), self.hidden_size), dtype=self.act_dtype, device=x.device)
        if self.clamped_swiglu is not None:
            swiglu = self._clamped_swiglu
        else:
            swiglu = kernels.silu_and_mul_cpu if x.device.type == "cpu" else kernels.silu_and_mul
        at = 0
        for e, n in zip(experts, counts):
            seg = slice(at, at + n)
            h = self.down[e](swiglu(self.gate_up[e](xs[seg])))
            torch.mul(h, ws[seg], out=ys[seg])
            at += n
        out = torch.zeros((x.shape[0], self.hidden_size), dtype=self.act_dtype, device=x.device)
        out.index_add_(0, tokens, ys)
        return out


    def _clamped_swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        alpha, limit = self.clamped_swiglu
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


class SharedExpertMoE:
    """``routed(x) + sigmoid(x @ gate.T) * shared(x)`` (Qwen2-MoE): the routed experts plus one
    dense expert every token takes, scaled per token by its own sigmoid gate (``gate`` ``[1, H]``,
    through ``F.linear`` as transformers computes it); without a gate (GraniteMoE-Shared)
    ``routed(x) + shared(x)``. Under tensor parallelism ``routed`` and ``shared`` give this rank's
    partial sums and the gate is whole on every rank, so the sum the ranks all-reduce is the whole
    block's."""

    __slots__ = ("routed", "shared", "gate")

    def __init__(self, routed, shared, gate: torch.Tensor | None):
        self.routed, self.shared, self.gate = routed, shared, gate

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared(x)
        if self.gate is not None:
            shared = torch.sigmoid(F.linear(x, self.gate)) * shared
        return self.routed(x) + shared


__all__ = ["MoE", "SharedExpertMoE"]
