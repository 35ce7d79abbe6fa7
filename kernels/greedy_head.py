"""The greedy token of an fp32 LM head from a bf16 GEMM, exactly: the same token as the argmax of
the full fp32 logits, ties and all, for about half the LM head's time where the CPU has bf16 dot
products (AVX512_BF16 or AMX).

A greedy row wants one number from the LM head, the index of the largest logit, yet the head is
the model's widest GEMM (vocab x hidden, ~10% of an fp32 decode step for a 135M model).
:class:`BoundedGreedyHead` computes approximate logits ``a = bf16(x) @ bf16(W)^T`` (fp32
accumulation) and, for each, a rigorous bound on its distance to the exact fp32 logit ``e``:

    |a_j - e_j| <= c * ||x|| * ||w_j|| + eps

    e_j    the fp32 GEMM's value (one fp32 FMA chain over K: error <= gamma(K) * S_j),
    a_j    bf16 inputs (relative error <= 2^-8 each: <= (2u + u^2) * S_j on the exact sum),
           summed in fp32 in any order (<= gamma(2K) * (1 + u)^2 * S_j), denormals flushed
           (<= eps, absolute),
    S_j = sum_i |x_i * W_ji| <= ||x|| * ||w_j|| (Cauchy-Schwarz), gamma(n) = n 2^-24 / (1 - n 2^-24).

A column whose upper bound lies below the best lower bound cannot be the argmax; the rest (the
candidates: 1-3 for a typical row of SmolLM2, 18 at most in a measured sample, where the bound is
about 10x the observed error) are recomputed with the fp32 GEMM's own arithmetic
(``csrc/gemm_f32.c``'s ``qw_gemm_f32_panel_row``: the same bits as the full head), and the first
of their maxima is the token. Rows the filter cannot settle (a non-finite value or bound, more
than 64 candidates) take the full fp32 head. The float rounding of the bound itself is covered by
inflating it (``_INFLATE``), far more than that rounding can take.

Only the token comes back: a row that needs logits (sampling, logprobs, penalties, a grammar) must
take the full head. The caller decides which rows qualify (:mod:`qworker.engine.sampler`).
"""

from __future__ import annotations

import math

import torch

from . import gemm_cpu
from .cpu import argmax_rows_cpu

_U = 2.0**-24  # fp32 unit roundoff
_U_BF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)
_INFLATE = 1.0 + 2.0**-10  # covers the fp32 rounding of s, wn, s * wn + eps and a -/+ b (each ~2^-24)
_SAFE = 2.0**100  # rows with ||x|| * max ||w_j|| past this take the full head (no overflow anywhere)


def _gamma(n: int) -> float:
    return n * _U / (1.0 - n * _U)


def _gemm_library():
    return gemm_cpu._gemm_library(torch.float32)


def bounded_head_supported() -> tuple[bool, str]:
    """Whether :class:`BoundedGreedyHead` is faster than the fp32 head here, and why not: it needs
    the compiled kernels and bf16 dot products (AVX512_BF16 or AMX) for its approximate GEMM."""
    if _gemm_library() is None:
        return False, "the CPU kernels are not built"
    if gemm_cpu.amx_kernel() is None:
        return False, "no AVX512_BF16 or AMX: a bf16 GEMM is no faster than the fp32 one here"
    return True, ""


class BoundedGreedyHead:
    """The greedy tokens of ``x @ W^T`` for an fp32 head ``W [V, K]`` packed for
    :func:`gemm_cpu.gemm` (``exact``: the packed fp32 weight the full head runs on; kept by
    reference). Holds a bf16 copy of ``W`` (half the fp32 head's bytes) and its row norms."""

    def __init__(self, exact: torch.Tensor, n_out: int):
        if exact.dtype != torch.float32 or exact.dim() != 3 or exact.shape[2] != gemm_cpu.NR:
            raise ValueError("BoundedGreedyHead takes an fp32 weight packed in panels (gemm_cpu.pack_weight)")
        self.exact = exact
        self.n_out = n_out
        self.K = exact.shape[1]
        self.approx = gemm_cpu.repack_bf16(exact)
        # row norms rounded up (double, then a relative nudge past fp32's rounding) and max |w|,
        # a block of panels at a time: no full-size temporary beside the bf16 copy
        norms, w_max = [], 0.0
        for p0 in range(0, exact.shape[0], 64):
            blk = exact[p0 : p0 + 64]
            norms.append(blk.double().square().sum(dim=1).sqrt().flatten())
            w_max = max(w_max, float(blk.abs().max()) if blk.numel() else 0.0)
        wn = torch.cat(norms)[:n_out] if norms else torch.zeros(0, dtype=torch.float64)
        self.wn = (wn * (1.0 + 2.0**-20)).float()
        self._wn_max = float(self.wn.max()) if self.wn.numel() else 0.0
        K = self.K
        self._c = _gamma(K) + _gamma(2 * K) * (1.0 + _U_BF16) ** 2 + 2 * _U_BF16 + _U_BF16**2
        # the flushed denormals: at most 2K results below 2^-126, and K products with one input
        # below 2^-126 (the other at most max|w| or max|x|, the latter added per row)
        self._eps_base = 2.0**-126 * K * (2.0 + w_max)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``(x @ W^T).argmax(dim=-1)`` (the first index of each row's maximum) for fp32 ``x [R, K]``,
        as a CPU int64 tensor, with the full head's values: identical to :func:`argmax_rows_cpu`
        over :func:`gemm_cpu.gemm`'s fp32 logits, including rows holding NaN or infinity."""
        if x.dim() != 2 or x.shape[1] != self.K or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"x must be fp32 [rows, {self.K}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        R, V, K = x.shape[0], self.n_out, self.K
        tokens = torch.empty(R, dtype=torch.int64)
        if R == 0:
            return tokens
        if K == 0 or V == 0:  # nothing to bound: the full head's answer
            return argmax_rows_cpu(gemm_cpu.gemm(x, self.exact, None, V))
        a = gemm_cpu.gemm(x.to(torch.bfloat16), self.approx, None, V, out_dtype=torch.float32)
        xd = x.double()
        norm = xd.norm(dim=1)
        s = norm * (self._c * _INFLATE)
        eps = ((self._eps_base + 2.0**-126 * K * xd.abs().amax(dim=1)) * _INFLATE).float()
        # rows whose products could overflow somewhere take the full head (s = inf makes them fail)
        s = torch.where(norm * self._wn_max < _SAFE, s, torch.full_like(s, math.inf)).float()
        # the row pass runs in the fp32 GEMM's own build: its exact values are that GEMM's bits
        _gemm_library().qw_greedy_head_f32(a.data_ptr(), R, V, a.stride(0), self.wn.data_ptr(), s.data_ptr(),
                                           eps.data_ptr(), x.data_ptr(), K, K, self.exact.data_ptr(),
                                           tokens.data_ptr(), torch.get_num_threads())
        full = torch.nonzero(tokens < 0).flatten()
        if full.numel():
            tokens[full] = argmax_rows_cpu(gemm_cpu.gemm(x[full], self.exact, None, V))
        return tokens
