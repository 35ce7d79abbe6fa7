"""fp32 GEMM for the CPU engine's projections, ``y = x @ W^T (+ bias)``, with ``W`` packed once
at load into 16-column panels (``csrc/gemm_f32.c``).

Packed layout: ``[ceil(N / 16), K, 16]`` fp32, panel ``p`` row ``k`` holding ``W[16p:16p+16, k]``
(columns past ``N`` zero), so the kernel streams each panel contiguously. The layout is the same
for every ISA build (AVX-512, AVX2+FMA, generic C), so one packed copy serves whichever build
:func:`kernels.cpu.cpu_isa` selects.

Usage::

    packed = pack_weight(linear.weight)          # once, at load
    y = gemm(x, packed, bias, n_out=linear.out_features)

:func:`gemm` takes ``x`` of shape ``[..., K]`` (fp32, CPU, unit stride along K; a row stride
other than K is passed to the kernel as is, a non-unit inner stride is copied once). Without the
compiled kernels (no compiler, ``QWORKER_CPU_KERNELS=0``) or for inputs it does not cover
(another dtype or device), it computes the same product with torch from the packed weight: same
signature, same result up to float rounding. Invalid shapes raise ``ValueError``.
"""

from __future__ import annotations

import torch

from . import cpu as _cpu

NR = 16  # panel width (floats); csrc/gemm_f32.c's NR


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` (``nn.Linear.weight``: out x in) -> packed ``[ceil(N / 16), K, 16]`` fp32,
    contiguous, a new tensor (``w`` is not kept)."""
    if w.dim() != 2:
        raise ValueError(f"pack_weight expects a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    N, K = w.shape
    panels = -(-N // NR)
    padded = torch.zeros((panels * NR, K), dtype=torch.float32, device=w.device)
    padded[:N] = w.detach()
    return padded.view(panels, NR, K).transpose(1, 2).contiguous()


def unpack_weight(packed: torch.Tensor, n_out: int) -> torch.Tensor:
    """The ``[n_out, K]`` weight back from its packed form (a copy)."""
    panels, K, nr = packed.shape
    return packed.transpose(1, 2).reshape(panels * nr, K)[:n_out].contiguous()


def _check(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> int:
    if packed.dim() != 3 or packed.shape[2] != NR:
        raise ValueError(f"packed weight must be [panels, K, {NR}] (see pack_weight), got shape {tuple(packed.shape)}")
    panels, K, _ = packed.shape
    if not (panels - 1) * NR < n_out <= panels * NR and not (n_out == 0 and panels == 0):
        raise ValueError(f"n_out={n_out} does not match a packed weight of {panels} panels of {NR} columns")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x's last dimension must be K={K}, got shape {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (n_out,):
        raise ValueError(f"bias must have shape ({n_out},), got {tuple(bias.shape)}")
    return K


def gemm(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None = None,
    n_out: int | None = None,
    *,
    out: torch.Tensor | None = None,
    threads: int | None = None,
    mc: int = 0,
    group: int = 0,
    kc: int = 0,
) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., n_out]`` fp32, ``W`` given packed by
    :func:`pack_weight`. ``n_out`` defaults to the padded width (``panels * 16``); pass the real
    N. ``out``: an optional fp32 CPU ``[rows, n_out]`` destination with unit column stride.
    ``threads`` defaults to ``torch.get_num_threads()``; ``mc``/``group``/``kc`` are the kernel's
    cache-blocking knobs (rows per x block, panels per weight group, K per block; 0 = defaults;
    for benchmarks and tests)."""
    if n_out is None:
        n_out = packed.shape[0] * NR if packed.dim() == 3 else -1
    K = _check(x, packed, bias, n_out)
    lead = x.shape[:-1]
    lib = _cpu._library()
    fn = getattr(lib, "qw_gemm_f32", None) if lib is not None else None
    covered = (
        fn is not None
        and x.dtype == torch.float32 and packed.dtype == torch.float32
        and x.is_cpu and packed.is_cpu and packed.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_cpu))
    )
    if not covered:
        y = torch.nn.functional.linear(x, unpack_weight(packed, n_out).to(x.dtype),
                                       None if bias is None else bias.to(x.dtype))
        if out is not None:
            out.copy_(y.reshape(out.shape))
            return out
        return y
    x2 = x.reshape(lead.numel(), K) if x.dim() != 2 else x  # not -1: K = 0 leaves it ambiguous
    if x2.shape[0] > 0 and K > 0 and (x2.stride(1) != 1 or x2.stride(0) < K):
        x2 = x2.contiguous()
    M = x2.shape[0]
    if out is not None:
        if (out.dtype != torch.float32 or out.device.type != "cpu" or out.dim() != 2
                or tuple(out.shape) != (M, n_out) or (M > 0 and n_out > 0 and (out.stride(1) != 1 or out.stride(0) < n_out))):
            raise ValueError(f"out must be a float32 CPU [{M}, {n_out}] tensor with unit column stride")
        y = out
    else:
        y = torch.empty((M, n_out), dtype=torch.float32)
    b = None if bias is None else bias.contiguous()
    if M and n_out:
        rc = fn(x2.data_ptr(), x2.stride(0) if M > 1 else K, packed.data_ptr(), None if b is None else b.data_ptr(),
                y.data_ptr(), y.stride(0) if M > 1 else n_out, M, n_out, K,
                torch.get_num_threads() if threads is None else int(threads), int(mc), int(group), int(kc))
        if rc != 0:
            raise ValueError(f"qw_gemm_f32 rejected M={M} N={n_out} K={K}")
    return y if out is not None or x.dim() == 2 else y.reshape(*lead, n_out)


def kernel_isa() -> int | None:
    """The loaded build's GEMM path: 2 = AVX-512, 1 = AVX2+FMA, 0 = generic C; None without kernels."""
    lib = _cpu._library()
    fn = getattr(lib, "qw_gemm_f32_isa", None) if lib is not None else None
    return None if fn is None else int(fn())
