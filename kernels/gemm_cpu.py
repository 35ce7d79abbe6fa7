"""GEMM for the CPU engine's projections, ``y = x @ W^T (+ bias)``, with ``W`` packed once at load
into 16-column panels: fp32 weights (``csrc/gemm_f32.c``) or bf16 weights (``csrc/gemm_bf16.c``,
the CPU bf16 mode: half the weight bytes to stream, fp32 arithmetic, no bf16 hardware needed).

Packed layout ("panels"): ``[ceil(N / 16), K, 16]`` in the weight's dtype (fp32, or bf16 for a
bf16 weight), panel ``p`` row ``k`` holding ``W[16p:16p+16, k]`` (columns past ``N`` zero), so the
kernel streams each panel contiguously. The layout is the same for every ISA build (AVX-512,
AVX2+FMA, generic C), so one packed copy serves whichever build :func:`kernels.cpu.cpu_isa` selects.

On CPUs with AMX or AVX512_BF16 (:func:`amx_layout_ready`), bf16 weights whose K is a multiple of
32 are packed instead in AMX's tile layout ("amx", ``csrc/gemm_amx.c``): ``[ceil(N / 16), K / 2,
32]``, element ``[p, k2, 2c + j]`` = ``W[16p + c, 2 k2 + j]``, a panel's 16 columns by a k pair in 64
bytes. bf16 x then runs on AMX tiles where the OS grants them, else with AVX512_BF16 dot products on
the same bytes (``csrc/gemm_pairs.c``: the same bits as the panels layout's dot-product kernel, in a
wider register tile and without its per-pair interleave); fp32 x, which neither kernel takes, runs
on torch. ``QWORKER_CPU_AMX=0`` keeps the panels layout.

Usage::

    packed = pack_weight(linear.weight)          # once, at load
    y = gemm(x, packed, bias, n_out=linear.out_features)

:func:`gemm` takes ``x`` of shape ``[..., K]`` (CPU, unit stride along K; a row stride other than
K is passed to the kernel as is, a non-unit inner stride is copied once): fp32 for fp32 weights;
fp32 or bf16 for bf16 weights (fp32 x is used as is, not rounded: callers wanting oneDNN's bf16
semantics round x to bf16 first, then every product is exact in fp32). bf16 weights return bf16 by
default (rounded to nearest even from the fp32 accumulator, like oneDNN's bf16 linear) or fp32 with
``out_dtype=torch.float32``. Without the compiled kernels (no compiler, ``QWORKER_CPU_KERNELS=0``)
or for inputs it does not cover (another dtype or device), it computes the same product with
torch from the packed weight: same signature, same result up to float rounding. Invalid shapes
raise ``ValueError``.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch

from . import cpu as _cpu
from .env import switch

log = logging.getLogger(__name__)

NR = 16  # panel width (floats); csrc/gemm_f32.c's NR
AMX_K = 32  # k per AMX tile: the amx layout needs K to be a multiple of it
LAYOUTS = ("panels", "amx")


def amx_layout_ready() -> bool:
    """Whether bf16 weights are packed in AMX's tile layout here: the GEMM build runs that layout
    (on AMX tiles where the OS grants this process AMX state, else with AVX512_BF16 dot products:
    :func:`amx_kernel`) and ``QWORKER_CPU_AMX`` is not ``0``."""
    return amx_layout_usable(_gemm_library(torch.bfloat16))


def amx_layout_usable(lib) -> bool:
    """:func:`amx_layout_ready` for a bf16 GEMM library the caller already holds (the per-call
    paths: no second lookup of the build)."""
    return lib is not None and switch("QWORKER_CPU_AMX") and _amx_kernel(lib) > 0


def amx_kernel() -> str | None:
    """What runs amx-packed weights here: ``"amx"`` (AMX tiles, ``csrc/gemm_amx.c``),
    ``"avx512_bf16"`` (dot products, ``csrc/gemm_pairs.c``) or None (the layout is not used)."""
    lib = _gemm_library(torch.bfloat16)
    if not amx_layout_usable(lib):
        return None
    return "amx" if _amx_kernel(lib) == 2 else "avx512_bf16"


@cache
def _amx_kernel(lib) -> int:
    fn = getattr(lib, "qw_gemm_bf16_amx_ready", None)
    return int(fn()) if fn is not None else 0


def is_amx_packed(packed: torch.Tensor) -> bool:
    """Whether ``packed`` is in the amx layout (else the panels one)."""
    return packed.dim() == 3 and packed.shape[2] == 2 * NR and packed.dtype == torch.bfloat16


def _bf16_layout(K: int) -> str:
    """The packing of a bf16 weight of K input features by default: amx where it runs here and K
    allows it, else panels."""
    return "amx" if K % AMX_K == 0 and K > 0 and amx_layout_ready() else "panels"


def pack_weight(w: torch.Tensor, layout: str | None = None) -> torch.Tensor:
    """``w [N, K]`` (``nn.Linear.weight``: out x in) -> packed, contiguous, a new tensor (``w`` is
    not kept): bf16 for a bf16 ``w`` (the bf16-weight kernels), else fp32. ``layout``: "panels"
    (``[ceil(N / 16), K, 16]``), "amx" (bf16 only, K a multiple of 32: ``[ceil(N / 16), K / 2,
    32]``), or None: amx where :func:`amx_layout_ready` and the weight allows it, else panels."""
    if w.dim() != 2:
        raise ValueError(f"pack_weight expects a 2-D [out, in] weight, got shape {tuple(w.shape)}")
    N, K = w.shape
    panels = -(-N // NR)
    dtype = torch.bfloat16 if w.dtype == torch.bfloat16 else torch.float32
    if layout is None:
        layout = _bf16_layout(K) if dtype == torch.bfloat16 else "panels"
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "amx" and (dtype != torch.bfloat16 or K % AMX_K):
        raise ValueError(f"the amx layout takes bf16 weights with K a multiple of {AMX_K}, got {w.dtype} K={K}")
    padded = torch.zeros((panels * NR, K), dtype=dtype, device=w.device)
    padded[:N] = w.detach()
    if layout == "amx":
        return padded.view(panels, NR, K // 2, 2).permute(0, 2, 1, 3).reshape(panels, K // 2, 2 * NR).contiguous()
    return padded.view(panels, NR, K).transpose(1, 2).contiguous()


def repack_bf16(packed: torch.Tensor, block: int = 256) -> torch.Tensor:
    """An fp32 weight packed in panels -> the bf16 packing :func:`pack_weight` gives its bf16
    rounding (amx where it would choose amx, else panels), built ``block`` panels at a time: the
    only full-size allocation is the result (half the fp32 weight's bytes)."""
    if packed.dtype != torch.float32 or packed.dim() != 3 or packed.shape[2] != NR:
        raise ValueError(f"repack_bf16 takes an fp32 weight packed in panels, got {packed.dtype} {tuple(packed.shape)}")
    panels, K, _ = packed.shape
    amx = _bf16_layout(K) == "amx"
    out = torch.empty((panels, K // 2, 2 * NR) if amx else (panels, K, NR), dtype=torch.bfloat16)
    for p0 in range(0, panels, block):
        blk = packed[p0 : p0 + block]
        if amx:  # [b, K, 16] -> [b, K / 2, 16, 2]: a panel's 16 columns by a k pair
            blk = blk.view(-1, K // 2, 2, NR).transpose(2, 3).reshape(-1, K // 2, 2 * NR)
        out[p0 : p0 + block] = blk
    return out


def unpack_weight(packed: torch.Tensor, n_out: int) -> torch.Tensor:
    """The ``[n_out, K]`` weight back from its packed form, either layout (a copy, in the packed
    dtype)."""
    if is_amx_packed(packed):
        panels, k2, _ = packed.shape
        return packed.view(panels, k2, NR, 2).permute(0, 2, 1, 3).reshape(panels * NR, 2 * k2)[:n_out].contiguous()
    panels, K, nr = packed.shape
    return packed.transpose(1, 2).reshape(panels * nr, K)[:n_out].contiguous()


def packed_k(packed: torch.Tensor) -> int:
    """The K (input features) of a packed weight, either layout."""
    return 2 * packed.shape[1] if is_amx_packed(packed) else packed.shape[1]


def _check(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n_out: int) -> int:
    if packed.dim() != 3 or not (packed.shape[2] == NR or is_amx_packed(packed)):
        raise ValueError(f"packed weight must be [panels, K, {NR}] or bf16 [panels, K / 2, {2 * NR}] (see pack_weight), "
                         f"got shape {tuple(packed.shape)}")
    panels, K = packed.shape[0], packed_k(packed)
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
    out_dtype: torch.dtype | None = None,
    threads: int | None = None,
    mc: int = 0,
    group: int = 0,
    kc: int = 0,
) -> torch.Tensor:
    """``x [..., K] @ W^T (+ bias)`` -> ``[..., n_out]``, ``W`` given packed by
    :func:`pack_weight`. ``n_out`` defaults to the padded width (``panels * 16``); pass the real
    N. fp32 weights: fp32 x and bias, fp32 result (``out_dtype`` None or float32). bf16 weights:
    x fp32 or bf16, bias None, fp32 or bf16, result ``out_dtype`` (default bf16, or float32), fp32
    accumulation either way. ``out``: an optional CPU ``[rows, n_out]`` destination of the result
    dtype with unit column stride. ``threads`` defaults to ``torch.get_num_threads()``;
    ``mc``/``group``/``kc`` are the kernel's cache-blocking knobs (rows per x block, panels per
    weight group, K per block; 0 = defaults; for benchmarks and tests)."""
    if n_out is None:
        n_out = packed.shape[0] * NR if packed.dim() == 3 else -1
    K = _check(x, packed, bias, n_out)
    if packed.dtype == torch.bfloat16:
        return _gemm_bf16(x, packed, bias, n_out, K, out, out_dtype, threads, mc, group, kc)
    if out_dtype not in (None, torch.float32):
        raise ValueError(f"out_dtype={out_dtype}: fp32 weights give float32 results (bf16 results need bf16 weights)")
    lead = x.shape[:-1]
    lib = _gemm_library()
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
        return _into(out, y, lead.numel(), n_out)
    x2 = _rows(x, lead, K)
    M = x2.shape[0]
    if out is not None:
        _check_out(out, torch.float32, M, n_out)
        y = out
        x2, bias = _unalias(y, x2, bias)
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


def f32_gemm_fn():
    """The C fp32 GEMM for callers that make many tiny calls (LoRA's per-adapter products), or
    None without kernels: ``fn(x, out, packed, n_out)`` writes ``x [M, K] @ W^T`` into ``out [M,
    n_out]``, both fp32 CPU views with unit column stride (rows any distance apart), ``packed``
    as :func:`pack_weight` gives it; none of :func:`gemm`'s checks. Each output is the same
    ordered sum as in :func:`gemm`."""
    lib = _gemm_library()
    fn = getattr(lib, "qw_gemm_f32", None) if lib is not None else None
    if fn is None:
        return None

    def run(x: torch.Tensor, out: torch.Tensor, packed: torch.Tensor, n_out: int) -> None:
        M, K = x.shape
        if M and n_out and fn(x.data_ptr(), x.stride(0), packed.data_ptr(), None, out.data_ptr(), out.stride(0), M, n_out, K,
                              torch.get_num_threads(), 0, 0, 0) != 0:
            raise ValueError(f"qw_gemm_f32 rejected M={M} N={n_out} K={K}")

    return run


def _gemm_bf16(x, packed, bias, n_out, K, out, out_dtype, threads, mc, group, kc) -> torch.Tensor:
    """:func:`gemm` for bf16-packed weights (``csrc/gemm_bf16.c``)."""
    odt = torch.bfloat16 if out_dtype is None else out_dtype
    if odt not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32 for bf16 weights, got {odt}")
    lead = x.shape[:-1]
    lib = _gemm_library(torch.bfloat16)
    amx = is_amx_packed(packed)
    fn = getattr(lib, "qw_gemm_bf16_amx" if amx else "qw_gemm_bf16", None) if lib is not None else None
    covered = (
        fn is not None
        and (x.dtype == torch.bfloat16 and amx_layout_usable(lib) if amx else x.dtype in (torch.float32, torch.bfloat16))
        and x.is_cpu and packed.is_cpu and packed.is_contiguous()
        and (bias is None or (bias.dtype in (torch.float32, torch.bfloat16) and bias.is_cpu))
    )
    if not covered:  # the same product in torch: x's values (not rounded), fp32 arithmetic, one rounding to odt
        y = torch.nn.functional.linear(x.float(), unpack_weight(packed, n_out).float(),
                                       None if bias is None else bias.float()).to(odt)
        return _into(out, y, lead.numel(), n_out)
    x2 = _rows(x, lead, K)
    M = x2.shape[0]
    if out is not None:
        _check_out(out, odt, M, n_out)
        y = out
        x2, bias = _unalias(y, x2, bias)
    else:
        y = torch.empty((M, n_out), dtype=odt)
    b = None if bias is None else bias.contiguous()
    if M and n_out:
        rc = fn(x2.data_ptr(), x2.stride(0) if M > 1 else K, int(x2.dtype == torch.bfloat16), packed.data_ptr(),
                None if b is None else b.data_ptr(), int(b is not None and b.dtype == torch.bfloat16),
                y.data_ptr(), y.stride(0) if M > 1 else n_out, int(odt == torch.bfloat16), M, n_out, K,
                torch.get_num_threads() if threads is None else int(threads), int(mc), int(group), int(kc))
        name = "qw_gemm_bf16_amx" if amx else "qw_gemm_bf16"
        if rc == -2:
            raise MemoryError(f"{name}: no scratch memory for M={M} N={n_out} K={K}")
        if rc != 0:
            raise ValueError(f"{name} rejected M={M} N={n_out} K={K} (rc {rc})")
    return y if out is not None or x.dim() == 2 else y.reshape(*lead, n_out)


def argmax_bf16(x: torch.Tensor, packed: torch.Tensor, n_out: int) -> torch.Tensor | None:
    """``gemm(x, packed, None, n_out).argmax(dim=-1)`` (int64 ``[rows]``) for amx-packed bf16 weights without
    bias, without the ``[rows, out]`` product: torch.argmax's answer on the bf16 output (the first
    index of each row's maximum, or of its first NaN). On AMX tiles only (``csrc/gemm_amx.c``
    ``qw_gemm_bf16_amx_argmax``); None where it does not run (the caller takes the product)."""
    if not (is_amx_packed(packed) and packed.is_cpu and packed.is_contiguous() and x.dim() == 2 and x.is_cpu):
        return None
    lib = _gemm_library(torch.bfloat16)
    fn = getattr(lib, "qw_gemm_bf16_amx_argmax", None) if lib is not None else None
    if fn is None or not amx_layout_usable(lib):
        return None
    K = packed_k(packed)
    if x.shape[1] != K:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {K}")
    x = x.to(torch.bfloat16)
    if x.stride(1) != 1:
        x = x.contiguous()
    M, N = x.shape[0], n_out
    if not 0 < N <= packed.shape[0] * NR:
        raise ValueError(f"n_out {N} does not fit the {packed.shape[0]} packed panels")
    out = torch.empty(M, dtype=torch.int64)
    rc = fn(x.data_ptr(), x.stride(0) if M > 1 else K, packed.data_ptr(), M, N, K, out.data_ptr(), torch.get_num_threads())
    if rc == -3:
        return None
    if rc == -2:
        raise MemoryError(f"qw_gemm_bf16_amx_argmax: no scratch memory for M={M} N={N} K={K}")
    if rc != 0:
        raise ValueError(f"qw_gemm_bf16_amx_argmax rejected M={M} N={N} K={K} (rc {rc})")
    return out


def _unalias(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` and ``bias``, copied where their memory overlaps the destination ``y`` (``out=x``, or
    views of one buffer): the kernels write y's tiles while later tiles still read x, so an aliased
    x would be read back half overwritten (torch's ``matmul(..., out=x)`` copies too)."""
    if _overlaps(y, x):
        x = x.clone()
    if bias is not None and _overlaps(y, bias):
        bias = bias.clone()
    return x, bias


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes ``a`` and ``b`` span intersect (conservative for strided views)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _rows(x: torch.Tensor, lead: torch.Size, K: int) -> torch.Tensor:
    """x as ``[rows, K]`` the kernels read: unit column stride, rows at least K apart (a row-strided
    view is passed through uncopied)."""
    x2 = x.reshape(lead.numel(), K) if x.dim() != 2 else x  # not -1: K = 0 leaves it ambiguous
    if x2.shape[0] > 0 and K > 0 and (x2.stride(1) != 1 or x2.stride(0) < K):
        x2 = x2.contiguous()
    return x2


def _into(out: torch.Tensor | None, y: torch.Tensor, M: int, n_out: int) -> torch.Tensor:
    """The torch fallback's result, in ``out`` when given: the same ``out`` the kernels take."""
    if out is None:
        return y
    _check_out(out, y.dtype, M, n_out)
    out.copy_(y.reshape(out.shape))
    return out


def _check_out(out: torch.Tensor, dtype: torch.dtype, M: int, n_out: int) -> None:
    if (out.dtype != dtype or out.device.type != "cpu" or out.dim() != 2 or tuple(out.shape) != (M, n_out)
            or (M > 0 and n_out > 0 and (out.stride(1) != 1 or out.stride(0) < n_out))):
        raise ValueError(f"out must be a {str(dtype).removeprefix('torch.')} CPU [{M}, {n_out}] tensor with unit column stride")


def kernel_isa(dtype: torch.dtype = torch.float32) -> int | None:
    """The GEMM path :func:`gemm` runs for ``dtype`` weights (float32 or bfloat16): 2 = AVX-512
    (for bf16 weights: AVX512_BF16 dot products for bf16 x, the AVX2 kernel for fp32 x),
    1 = AVX2+FMA, 0 = generic C; None without kernels."""
    lib = _gemm_library(dtype)
    name = "qw_gemm_bf16_isa" if dtype == torch.bfloat16 else "qw_gemm_f32_isa"
    fn = getattr(lib, name, None) if lib is not None else None
    return None if fn is None else int(fn())


# Which kernels build's GEMM runs. By default the active build's (kernels.cpu.cpu_isa()); on an
# AVX-512 CPU that build has its own fp32 micro-kernel (12 x 32 tiles), which choose_gemm_isa
# weighs against the avx2 build's (6 x 16) once per process, for fp32 weights only (bf16 weights
# keep the active build: its AVX512_BF16 dot-product kernel, where the CPU has one). QWORKER_CPU_GEMM_ISA (read once)
# forces a build; using_gemm_isa(), and kernels.cpu.using_isa() for every kernel, override both
# (tests, benchmarks).
_gemm_isa_override: list[str] = []
_gemm_isa_choice: dict[str, str] = {}  # active kernels ISA -> the build whose GEMM it runs
# the AVX-512 kernel is kept unless the measurement finds it this much slower than AVX2's. The
# one-thread measurement undersells it: on a Zen 4 it found AVX-512 1-2% faster where a whole
# 48-request run was 6% faster (docs/benchmarks.md, "Zen 4, a fourth day"), so at 5% a noisy
# start-up could have given the run away
_KEEP_AVX512_UNLESS_SLOWER = 1.10


def gemm_isa(dtype: torch.dtype = torch.float32) -> str | None:
    """The kernels build ("avx512", "avx2" or "generic") whose GEMM :func:`gemm` runs for
    ``dtype`` weights, or None without kernels (``QWORKER_CPU_KERNELS=0``, no compiler)."""
    if _cpu._library() is None:
        return None
    if _gemm_isa_override:
        return _gemm_isa_override[-1]
    if _cpu._isa_override:  # kernels.cpu.using_isa(): that build, its GEMM included
        return _cpu.cpu_isa()
    active = _cpu.cpu_isa()
    chosen = _gemm_isa_choice.get(active, active) if dtype == torch.float32 else active  # the choice weighs fp32 only
    return _forced_gemm_isa() or chosen


def _gemm_library(dtype: torch.dtype = torch.float32):
    isa = gemm_isa(dtype)
    return None if isa is None else _cpu._library_for(isa)


@contextmanager
def using_gemm_isa(isa: str) -> Iterator[None]:
    """Run the GEMM of another available build inside the block, whatever the other kernels run
    (process-wide, not thread-safe)."""
    if isa not in _cpu.available_isas():
        raise ValueError(f"ISA {isa!r} is not available on this CPU (available: {', '.join(_cpu.available_isas())})")
    _gemm_isa_override.append(isa)
    try:
        yield
    finally:
        _gemm_isa_override.pop()


@cache
def _forced_gemm_isa() -> str:
    """``QWORKER_CPU_GEMM_ISA`` (read at first use; it must name a build this CPU runs), or ""."""
    forced = os.environ.get("QWORKER_CPU_GEMM_ISA", "").strip().lower()
    if forced and forced not in _cpu.available_isas():
        raise ValueError(f"QWORKER_CPU_GEMM_ISA={forced}: not a kernels build this CPU runs "
                         f"(available: {', '.join(_cpu.available_isas())})")
    return forced


def self_check(dtype: torch.dtype) -> str:
    """"" when :func:`gemm`'s kernel equals torch on every tile shape the builds have (1-3 rows
    widening over up to 8 panels, balanced row tiles of both main-tile heights, a partial last
    panel, odd K, several K blocks continuing from y), else why not. Run at start-up, because the
    micro-kernels of a build are only ever compiled for the CPU they run on."""
    if kernel_isa(dtype) is None:
        return f"the CPU C kernels are unavailable (no compiler, QWORKER_CPU_KERNELS=0, or the {gemm_isa(dtype)} build failed)"
    gen = torch.Generator().manual_seed(0)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    # (N, K, rows, kc): 40 = 2 panels + a partial one; 136 = 8 + a partial one (AVX-512's 1-row
    # tile spans 8 panels, its 2-3-row ones 4); kc 16 cuts K = 33 into 3 blocks
    cases = [(40, 33, rows, 0) for rows in (1, 2, 3, 5, 13, 25, 70)] + [(136, 33, rows, 0) for rows in (1, 2, 3, 13)]
    cases += [(136, 33, rows, 16) for rows in (1, 3, 13)]
    cases = [(*case, "panels") for case in cases]
    if dtype == torch.bfloat16 and amx_layout_ready():
        # the amx layout (AMX tiles, or AVX512_BF16 dot products without AMX): one row tile by 1-3
        # panels (N = 40: 2 + a partial one), 2 x 2 row tiles by panels with an odd last row tile
        # and panel (N = 136: 8 + a partial one), ragged last rows
        cases += [(N, 64, rows, 0, "amx") for N in (40, 136) for rows in (1, 3, 16, 17, 33, 70)]
    for N, K, rows, kc, layout in cases:
        w, b = torch.randn(N, K, generator=gen).to(dtype), torch.randn(N, generator=gen)
        x = torch.randn(rows, K, generator=gen).to(dtype)
        want = x.float() @ w.float().t() + b
        if not torch.allclose(gemm(x, pack_weight(w, layout), b, N, kc=kc).float(), want, rtol=tol, atol=tol):
            return (f"the {layout} GEMM gave wrong results on the start-up check ({dtype}, {rows} rows, N={N}, kc={kc}, "
                    f"{gemm_isa(dtype)} build)")
    return ""


def choose_gemm_isa(sample: list[torch.Tensor], rows=(1, 16, 128), rounds: int = 3) -> str | None:
    """Where the active build is "avx512" (its own AVX-512 fp32 micro-kernel) and nothing forces a
    build: time its GEMM against the avx2 build's on ``sample`` (``[out, in]`` fp32 weights, e.g.
    two layers' projections), one thread's CPU time, builds alternating round by round, and keep
    AVX-512 unless it is 10% slower or fails :func:`self_check`. Once per process; returns
    :func:`gemm_isa`."""
    active = _cpu.cpu_isa() if _cpu._library() is not None else None
    if (active != "avx512" or _gemm_isa_override or _forced_gemm_isa() or active in _gemm_isa_choice
            or "avx2" not in _cpu.available_isas() or not sample):
        return gemm_isa()
    candidates = []
    for isa in ("avx512", "avx2"):
        with using_gemm_isa(isa):
            why = self_check(torch.float32)  # also refuses a build whose library did not compile
        if why:
            log.warning("fp32 GEMM: the %s build fails its check, not used: %s", isa, why)
        else:
            candidates.append(isa)
    if len(candidates) < 2:
        _gemm_isa_choice[active] = candidates[0] if candidates else active
        return gemm_isa()
    times = _time_gemm_builds(candidates, [pack_weight(w.float()) for w in sample], [w.shape[0] for w in sample], rows, rounds)
    choice = "avx512" if times["avx512"] <= _KEEP_AVX512_UNLESS_SLOWER * times["avx2"] else "avx2"
    log.info("fp32 GEMM: %s micro-kernel (start-up check, one thread: %s)", choice,
             ", ".join(f"{isa} {t * 1e3:.2f} ms" for isa, t in times.items()))
    _gemm_isa_choice[active] = choice
    return gemm_isa()


def _time_gemm_builds(isas: list[str], packed: list[torch.Tensor], n_out: list[int], rows, rounds: int) -> dict[str, float]:
    """Median seconds (this thread's CPU time) per build of one pass over every weight at each row
    count, summed over the row counts."""
    gen = torch.Generator().manual_seed(0)
    inputs = {(r, p.shape[1]): torch.randn(r, p.shape[1], generator=gen) for r in rows for p in packed}
    times: dict[str, list[float]] = {isa: [] for isa in isas}
    for round_ in range(rounds + 1):  # round 0 warms the caches and pages up
        for isa in isas:
            with using_gemm_isa(isa):
                start = time.thread_time()
                for r in rows:
                    for p, n in zip(packed, n_out):
                        gemm(inputs[r, p.shape[1]], p, None, n, threads=1)
                if round_:
                    times[isa].append(time.thread_time() - start)
    return {isa: statistics.median(t) for isa, t in times.items()}
