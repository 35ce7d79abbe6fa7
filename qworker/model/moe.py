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
  runs ``min(E, B * top_k)`` small GEMM pairs instead of a per-token loop. fp32 experts on the
  panels GEMM without biases (every fp32 MoE family but gpt-oss and Llama 4) run the same steps
  in one C call instead (:mod:`kernels.moe_cpu`: one OpenMP region, not two GEMM calls per
  active expert), with the same bits (``QWORKER_CPU_MOE_KERNEL=0``: the grouped path, for A/B runs).
* ``"triton"``: the fused grouped GEMM of :func:`kernels.moe_experts` (:mod:`kernels.fused_moe`) over the stacked weights;
  experts with biases or gpt-oss's clamped SwiGLU take the grouped path above on the device.

DeepSeek-V2/V3 and GLM-4.5 route otherwise (:class:`Routing`): scores by softmax or sigmoid,
experts picked by the scores plus a per-expert bias (V3's ``e_score_correction_bias``, used for
the choice only), within the best ``topk_group`` of ``n_group`` expert groups, their weights then
multiplied by ``routed_scaling_factor``.

Llama 4 weighs each expert's input instead of its output (``scale_inputs``): ``expert(x * w)``.

gpt-oss: the router has a bias, the experts have biases, and the activation is the clamped
SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=l)``
(``clamped_swiglu=(alpha, l)``).

Rounding follows transformers' eager experts loop: each expert's output is multiplied by its fp32
routing weight (Mixtral), or by the weight rounded to the activation dtype first
(``weights_in_act_dtype``: Qwen3-MoE and OLMoE), and the products are added in ascending expert
order per token. In fp32 this matches transformers up to GEMM rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import kernels
from kernels.env import switch
from kernels.moe_cpu import PackedExperts
from qworker.model.linear import Linear


@dataclass(frozen=True, eq=False)
class Routing:
    """How a router turns its logits into ``top_k`` experts and their weights, as transformers'
    DeepSeek-V2/V3 and GLM-4.5 routers do (the defaults are Mixtral's softmax top-k).

    ``scoring``: "softmax" or "sigmoid" of the fp32 logits. ``choice_bias`` ``[E]``: added to the
    scores to pick the experts; each picked expert is weighed by its score without it.
    ``groups``: ``(n, kept, "max" | "top2")``: the experts fall into ``n`` equal groups, each scored
    by its best expert ("max", V2) or its best two summed ("top2", V3); only the ``kept`` best
    groups' experts can be picked (V2 zeroes the others' scores, V3 makes them -inf).
    ``scoring`` "sparsemixer" (Phi-3.5-MoE, top-2, as it runs at inference): the best expert by
    logit, weighed by the softmax over the logits within ``2 * jitter_eps`` of the best (relative
    to ``max(|logit|, best)``); then the best of the others, weighed the same way over the
    others. ``routed_scale``: the weights (after any renormalisation) times this. ``renormalize_floor``:
    renormalised weights divide by ``max(sum, floor)`` (ERNIE 4.5's ``moe_norm_min``; 0: by the
    sum plus transformers' 1e-20, as DeepSeek-V3). Sigmoid scores with
    neither a choice bias nor groups (Llama 4) pick by the logits themselves: the same order, but
    no ties where fp32 sigmoids of large logits round to 1."""

    scoring: str = "softmax"
    choice_bias: torch.Tensor | None = None
    groups: tuple[int, int, str] | None = None
    routed_scale: float = 1.0
    renormalize_floor: float = 0.0
    jitter_eps: float = 0.0

    def plain(self) -> bool:
        """Mixtral's softmax top-k (the default)."""
        return (self.scoring == "softmax" and self.choice_bias is None and self.groups is None and self.routed_scale == 1.0
                and self.renormalize_floor == 0.0)

    def check(self, num_experts: int, top_k: int) -> None:
        if self.scoring not in ("softmax", "sigmoid", "sparsemixer"):
            raise ValueError(f"router scoring must be 'softmax', 'sigmoid' or 'sparsemixer', got {self.scoring!r}")
        if self.scoring == "sparsemixer" and (top_k != 2 or self.choice_bias is not None or self.groups is not None):
            raise ValueError("SparseMixer routing picks 2 experts, without a choice bias or groups")
        if self.choice_bias is not None and tuple(self.choice_bias.shape) != (num_experts,):
            raise ValueError(f"the router's choice bias has shape {list(self.choice_bias.shape)}, expected [{num_experts}]")
        if self.groups is not None:
            n, kept, score = self.groups
            if n < 1 or num_experts % n or not 1 <= kept <= n or score not in ("max", "top2"):
                raise ValueError(f"cannot route {num_experts} experts in n_group={n} groups keeping topk_group={kept}")
            if score == "top2" and num_experts // n < 2:
                raise ValueError(f"groups of {num_experts // n} expert(s) cannot be scored by their best two (n_group={n})")
            if kept * (num_experts // n) < top_k:
                raise ValueError(f"num_experts_per_tok={top_k} is more than the {kept * (num_experts // n)} experts "
                                 f"of the topk_group={kept} groups kept")


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
        routing: Routing = Routing(),
        scale_inputs: bool = False,  # Llama 4: each expert reads x times its weight, its output is not weighed
    ):
        E, two_i, H = gate_up.shape
        if router.shape != (E, H) or down.shape != (E, H, two_i // 2) or two_i % 2:
            raise ValueError(f"MoE weights disagree: router {tuple(router.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}")
        if not 1 <= top_k <= E:
            raise ValueError(f"top_k must be in 1..{E} (the number of experts), got {top_k}")
        if kernel_backend not in ("cpu", "triton"):
            raise ValueError(f"kernel_backend must be 'cpu' or 'triton', got {kernel_backend!r}")
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, two_i // 2
        routing.check(E, top_k)
        self.top_k = top_k
        self.renormalize = renormalize
        self.routing = routing
        self.choice_bias = None if routing.choice_bias is None else routing.choice_bias.float().contiguous()
        self.act_dtype = act_dtype
        self.kernel_backend = kernel_backend
        self.weights_in_act_dtype = weights_in_act_dtype
        # fp32 [E, H] through F.linear, the very call transformers makes in fp32: the same logits to
        # the bit, so near-ties between experts are settled the same way. A copy of its own: a view
        # into the checkpoint's mmap sits at whatever offset the file gives it, and the GEMM's
        # rounding follows the address's alignment (the same router in another file gave logits 1 ulp apart)
        self.router = router.float().clone(memory_format=torch.contiguous_format)
        self.router_bias = None if router_bias is None else router_bias.float().contiguous()
        self.clamped_swiglu = clamped_swiglu
        self.scale_inputs = scale_inputs
        # the fused Triton kernel runs plain SwiGLU experts without biases, weighing outputs; others go through Linear
        self.fused = (kernel_backend == "triton" and gate_up_bias is None and down_bias is None and clamped_swiglu is None
                      and not scale_inputs)
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
        # fp32 panels experts with plain SwiGLU and no biases: the grouped path in one C call (same bits)
        self.packed = None
        if (not self.fused and linear_backend == "panels" and act_dtype == torch.float32 and gate_up.dtype == torch.float32
                and gate_up_bias is None and down_bias is None and clamped_swiglu is None and not scale_inputs
                and top_k <= PackedExperts.MAX_TOP_K and switch("QWORKER_CPU_MOE_KERNEL")):
            packed = PackedExperts([lin.weight for lin in self.gate_up], [lin.weight for lin in self.down], H, two_i // 2)
            self.packed = packed if packed.available() else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights fp32 [T, K], topk_ids int64 [T, K])`` for ``x`` ``[T, H]``."""
        logits = F.linear(x.float(), self.router, self.router_bias)
        r = self.routing
        if r.plain():
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.renormalize:
                weights /= weights.sum(dim=-1, keepdim=True)
            return weights, ids
        if r.scoring == "sparsemixer":
            return _sparsemixer(logits, r.jitter_eps)
        scores = torch.sigmoid(logits) if r.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        if self.choice_bias is not None:
            choice = scores + self.choice_bias
        else:  # sigmoid alone (Llama 4) picks by the logits: no ties where fp32 sigmoids round to 1
            choice = logits if r.scoring == "sigmoid" and r.groups is None else scores
        if r.groups is not None:
            n, kept, how = r.groups
            grouped = choice.view(choice.shape[0], n, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if how == "top2" else grouped.amax(dim=-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, torch.topk(group_scores, kept, dim=-1, sorted=False)[1], True)
            # V2 zeroes the dropped groups' softmax scores (still above none of the kept ones), V3 drops them
            choice = grouped.masked_fill(~keep.unsqueeze(-1), 0.0 if how == "max" else -math.inf).view(choice.shape)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize and r.renormalize_floor > 0:
            weights /= weights.sum(dim=-1, keepdim=True).clamp(min=r.renormalize_floor)
        elif self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20  # transformers' epsilon (no sum of sigmoids is that small)
        if r.routed_scale != 1.0:
            weights *= r.routed_scale
        return weights, ids

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.packed is not None:  # built only for fp32 activations on CPU
            return self.packed(x, ids, weights)
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
        if self.scale_inputs:
            xs = xs * ws.to(xs.dtype)
        ys = torch.empty((flat.numel(), self.hidden_size), dtype=self.act_dtype, device=x.device)
        if self.clamped_swiglu is not None:
            swiglu = self._clamped_swiglu
        else:
            swiglu = kernels.silu_and_mul_cpu if x.device.type == "cpu" else kernels.silu_and_mul
        at = 0
        for e, n in zip(experts, counts):
            seg = slice(at, at + n)
            h = self.down[e](swiglu(self.gate_up[e](xs[seg])))
            if self.scale_inputs:
                ys[seg] = h
            else:
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


def _sparsemixer(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseMixer's two picks at inference, as transformers' Phi-3.5-MoE computes them: each the
    maximum of the logits left (the first pick's set to -inf for the second), weighed by its share
    of a softmax over the logits not more than ``2 * jitter_eps`` below that maximum, relative to
    ``max(|logit|, maximum)``."""
    weights, ids = [], []
    left = logits
    for _ in range(2):
        best, pick = left.max(dim=-1, keepdim=True)
        far = ((best - logits) / logits.abs().clamp(min=best)) > 2 * jitter_eps
        weights.append(torch.softmax(left.masked_fill(far, -math.inf), dim=-1).gather(-1, pick))
        ids.append(pick)
        left = left.scatter(-1, pick, -math.inf)
    return torch.cat(weights, dim=-1), torch.cat(ids, dim=-1)


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


__all__ = ["MoE", "Routing", "SharedExpertMoE"]
