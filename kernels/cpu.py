"""The CPU engine's C kernels: paged decode attention that reads K/V pages in place, and the
per-layer elementwise work (residual add + RMSNorm, rotary embedding, the KV write, SwiGLU) in
one call each.

The torch reference (:func:`kernels.reference.paged_decode_attention_ref`) must gather every
sequence's pages into a contiguous copy before one SDPA call; on a CPU that copy costs as much as
the attention itself (decode is memory-bound, and the gather reads and writes the whole context
once more). ``csrc/paged_decode.c`` walks the block table instead, as the Triton kernel does on
the GPU, and reads an fp16 or bf16 cache as well as an fp32 one. Under a sliding window it reads
only the pages holding the window (the plain path is the same loop from token 0), and it applies
Gemma 2's score soft-capping in its softmax pass. ``csrc/elementwise.c`` replaces the 2-15
small torch ops per norm, rotary, KV write or SwiGLU, whose dispatch cost dominates at decode
batch sizes. The sources are compiled on first use with the system C compiler (``-O3
-march=native -fopenmp``, about a second) into a per-user cache (``$QWORKER_KERNEL_CACHE``, else
``$XDG_CACHE_HOME/qworker/kernels``) keyed by the sources, the flags and this CPU's feature flags,
and loaded with ctypes (which releases the GIL during the call).

Without a compiler, with ``QWORKER_CPU_KERNELS=0``, or for inputs a kernel does not cover (fp32
activations are required; non-contiguous layouts), every function here runs its torch reference:
same signature, same results up to float rounding.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from .env import switch
from .reference import paged_decode_attention_ref, paged_prefill_attention_ref, rms_norm_ref, rotary_embedding_ref, silu_and_mul_ref, store_kv_ref

log = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).with_name("csrc")
_SOURCES = sorted(_SOURCE_DIR.glob("*.c"))
_HEADERS = sorted(_SOURCE_DIR.glob("*.h"))
# -fno-trapping-math lets gcc vectorise the exp and silu loops (their selects); results are unchanged
_FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
# One build per vector ISA, on top of -march=native: the attention kernels have an AVX-512 path
# (__AVX512F__), an AVX2+FMA path and a scalar one, and each build compiles the best path its flags
# allow. On an AVX-512 CPU the "avx512" build is the plain -march=native build with the fp32 GEMM's
# AVX-512 micro-kernel switched on (QW_GEMM_AVX512; kernels/gemm_cpu.py can still run the avx2
# build's GEMM where a start-up measurement finds it faster, see gemm_cpu.choose_gemm_isa).
ISAS = ("avx512", "avx2", "generic")
_ISA_FLAGS = {"avx512": ["-DQW_GEMM_AVX512"], "avx2": ["-mno-avx512f"], "generic": ["-mno-avx"]}
# the /proc/cpuinfo flags each build needs (x86); "generic" runs anywhere
_ISA_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"},
              "avx2": {"avx2", "fma", "f16c"}, "generic": set()}
_isa_override: list[str] = []  # innermost using_isa() last


@cache
def _cpu_features() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def available_isas() -> list[str]:
    """The kernel builds this CPU can run, best first (only "generic" off x86)."""
    return list(_available_isas())


@cache
def _available_isas() -> tuple[str, ...]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ("generic",)
    flags = set(_cpu_features().split())
    return tuple(isa for isa in ISAS if _ISA_NEEDS[isa] <= flags)


@cache
def _default_isa() -> str:
    """``QWORKER_CPU_ISA`` when set (it must name an ISA this CPU has), else the best available."""
    forced = os.environ.get("QWORKER_CPU_ISA", "").strip().lower()
    have = available_isas()
    if forced:
        if forced not in ISAS:
            raise ValueError(f"QWORKER_CPU_ISA must be one of {', '.join(ISAS)}, got {forced!r}")
        if forced not in have:
            raise ValueError(f"QWORKER_CPU_ISA={forced}: this CPU lacks it (available: {', '.join(have)})")
        return forced
    return have[0]


def cpu_isa() -> str:
    """The vector ISA whose build the CPU kernels run: "avx512", "avx2" or "generic"."""
    return _isa_override[-1] if _isa_override else _default_isa()


@contextmanager
def using_isa(isa: str) -> Iterator[None]:
    """Run the kernels of another available ISA's build inside the block (tests, benchmarks);
    process-wide, not thread-safe."""
    if isa not in _available_isas():
        raise ValueError(f"ISA {isa!r} is not available on this CPU (available: {', '.join(available_isas())})")
    _isa_override.append(isa)
    try:
        yield
    finally:
        _isa_override.pop()


def _cache_dir() -> Path:
    root = os.environ.get("QWORKER_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qworker", "kernels"
    )
    return Path(root)


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_DECODE_ARGS = [_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32, _F32, _I32, _I64, _I32, _F32, _P]
# q, q_row_stride, k_cache, v_cache, tables, table_stride, query_start_loc, seq_lens, out, out_row_stride, B, Hq, Hkv,
# D, block_size, scale, threads, num_blocks, window, softcap, sinks (fp32 [Hq] or NULL)
_EXTEND_ARGS = [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32, _F32, _I32, _I64, _I32, _F32, _P]
_STORE_ARGS = [_P, _P, _I64, _I64, _P, _P, _P, _I64, _I32, _I64]
# C function -> (argument types, return type); the *_f16 ones exist only in F16C builds
_SIGNATURES = {
    "qw_paged_decode_f32": (_DECODE_ARGS, ctypes.c_int),
    "qw_paged_decode_f16": (_DECODE_ARGS, ctypes.c_int),
    "qw_paged_decode_bf16": (_DECODE_ARGS, ctypes.c_int),
    "qw_paged_decode_bf16_dp": (_DECODE_ARGS, ctypes.c_int),
    "qw_paged_extend_f32": (_EXTEND_ARGS, ctypes.c_int),
    "qw_paged_extend_f16": (_EXTEND_ARGS, ctypes.c_int),
    "qw_paged_extend_bf16": (_EXTEND_ARGS, ctypes.c_int),
    "qw_paged_extend_bf16_products": (_EXTEND_ARGS, ctypes.c_int),
    "qw_paged_extend_bf16_products_kernel": ([_I32], ctypes.c_int),
    "qw_paged_decode_bf16_dp_kernel": ([_I32, _I32, _I32], ctypes.c_int),
    "qw_store_kv_f32": (_STORE_ARGS, ctypes.c_int),
    "qw_store_kv_f16": (_STORE_ARGS, ctypes.c_int),
    "qw_store_kv_bf16": (_STORE_ARGS, ctypes.c_int),
    "qw_add_rms_norm_f32": ([_P, _P, _P, _P, _P, _I64, _I32, _F32, _I32], None),
    "qw_rope_f32": ([_P, _P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32], None),
    "qw_silu_mul_f32": ([_P, _P, _I64, _I32, _I32], None),
    "qw_add_rms_norm_bf16out": ([_P, _I32, _P, _P, _P, _P, _I64, _I32, _F32, _I32], None),
    "qw_silu_mul_bf16": ([_P, _P, _I64, _I32, _I32], None),
    "qw_argmax_rows_f32": ([_P, _I64, _I64, _I64, _P, _I32], None),
    "qw_argmax_rows_bf16": ([_P, _I64, _I64, _I64, _P, _I32], None),
    # a, rows, cols, lda, wn, s, eps, x, ldx, K, fp32 panels, tokens, threads (csrc/greedy_head.c)
    "qw_greedy_head_f32": ([_P, _I64, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _P, _P, _I32], None),
    # x, ldx, packed w, bias, y, ldy, M, N, K, threads, mc, group, kc (kernels/gemm_cpu.py)
    "qw_gemm_f32": ([_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I32, _I64, _I64, _I64], ctypes.c_int),
    "qw_gemm_f32_isa": ([], ctypes.c_int),
    # x, T, H, I, E, topk, ids, weights, gate_up addresses, down addresses, out, threads, SwiGLU row fn (csrc/moe_cpu.c)
    "qw_moe_f32": ([_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I32, _P], ctypes.c_int),
    # x, ldx, x_bf16, packed bf16 w, bias, bias_bf16, y, ldy, y_bf16, M, N, K, threads, mc, group, kc (csrc/gemm_bf16.c)
    "qw_gemm_bf16": ([_P, _I64, _I32, _P, _P, _I32, _P, _I64, _I32, _I64, _I64, _I64, _I32, _I64, _I64, _I64], ctypes.c_int),
    "qw_gemm_bf16_isa": ([], ctypes.c_int),
    # the same arguments as qw_gemm_bf16, weights in AMX's layout (csrc/gemm_amx.c)
    "qw_gemm_bf16_amx": ([_P, _I64, _I32, _P, _P, _I32, _P, _I64, _I32, _I64, _I64, _I64, _I32, _I64, _I64, _I64], ctypes.c_int),
    "qw_gemm_bf16_amx_ready": ([], ctypes.c_int),
    # x, ldx, packed gate/up w, act, ld act, M, I, K, threads (csrc/gemm_amx.c)
    "qw_gemm_bf16_amx_swiglu": ([_P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I32], ctypes.c_int),
    # x, ldx, packed w, M, N, K, out (int64 [M]), threads (csrc/gemm_amx.c)
    "qw_gemm_bf16_amx_argmax": ([_P, _I64, _P, _I64, _I64, _I64, _P, _I32], ctypes.c_int),
    # layers (qw_layer[]), num_layers, step (qw_step *) (csrc/decoder_layers.c, kernels/decoder_cpu.py)
    "qw_decoder_layers_f32": ([_P, _I32, _P], ctypes.c_int),
    "qw_decoder_layers_bf16": ([_P, _I32, _P], ctypes.c_int),
}


def _library() -> ctypes.CDLL | None:
    """The compiled kernels of the active ISA's build, or None when they cannot be built."""
    if not switch("QWORKER_CPU_KERNELS"):
        return None
    return _library_for(cpu_isa())


@cache
def _library_for(isa: str) -> ctypes.CDLL | None:
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    path = _build(_ISA_FLAGS[isa] + _amx_emulation_flags(isa) if x86 else [])
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        if hasattr(lib, name):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
    log.info("CPU kernels: %s build (%s)", isa, path.name)
    return lib


def _amx_emulation_flags(isa: str) -> list[str]:
    """``QWORKER_CPU_AMX_EMULATE=1``, for tests only: the avx512 build compiles its AMX kernels on
    software tiles (``csrc/amx_emulate.h``, which aborts where the hardware would fault), so the AMX
    code runs, and is checked, on an AVX512_BF16 CPU without AMX. Orders of magnitude slower."""
    if not switch("QWORKER_CPU_AMX_EMULATE") or isa != "avx512":
        return []
    if "avx512_bf16" not in _cpu_features().split():
        raise ValueError("QWORKER_CPU_AMX_EMULATE=1 needs a CPU with AVX512_BF16 (the AMX kernels' other half)")
    return ["-mamx-tile", "-mamx-bf16", "-DQW_AMX_EMULATE"]


def _build(isa_flags: list[str]) -> Path | None:
    """Compile the sources once per (sources, flags, compiler, CPU) into the first writable cache
    directory; the path of the shared library, or None (logged) when that fails."""
    compiler = os.environ.get("CC", "cc")
    flags = _FLAGS + isa_flags
    parts = [*(src.read_bytes() for src in _SOURCES + _HEADERS), " ".join(flags).encode(), compiler.encode(),
             _cpu_features().encode(), platform.machine().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    for directory in (_cache_dir(), Path(tempfile.gettempdir()) / f"qworker-kernels-{os.getuid()}"):
        target = directory / f"qworker_cpu-{key}.so"
        if target.exists():
            return target
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # build beside the target, then rename: concurrent processes never load a torn file
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
            os.close(fd)
        except OSError:
            continue  # not writable: try the next directory
        try:
            subprocess.run([compiler, *flags, "-o", tmp, *map(str, _SOURCES)], check=True, capture_output=True, timeout=300)
            os.replace(tmp, target)
            return target
        except (OSError, subprocess.SubprocessError) as exc:
            detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")[-500:]
            log.warning("CPU kernels unavailable, using the torch references: %s %s", exc, detail)
            return None
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    log.warning("CPU kernels unavailable (no writable cache directory), using the torch references")
    return None


def cpu_kernels_available() -> bool:
    return _library() is not None


_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _cache_fn(name: str, cache_dtype: torch.dtype):
    """The C function ``name`` for this cache dtype, or None (no library, dtype not built)."""
    lib = _library()
    suffix = _SUFFIX.get(cache_dtype)
    return getattr(lib, f"{name}_{suffix}", None) if lib is not None and suffix else None


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    bf16_products: bool = False,
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference.paged_decode_attention_ref` (``num_splits`` is
    ignored: the kernel parallelises over sequences and KV heads). ``bf16_products`` (the CPU bf16
    mode), with a bf16 cache: the two products in bf16 with AVX512_BF16 dot products where the
    build has them and the head size is 64 or 128 (the scaled query and the softmax numerators
    rounded to bf16, as the AMX extend kernel; ``csrc/paged_decode.c``), fp32 products elsewhere."""
    opts = dict(out=out, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    lib = _library()
    dp = bf16_products and k_cache.dtype == torch.bfloat16 and lib is not None
    fn = getattr(lib, "qw_paged_decode_bf16_dp", None) if dp else _cache_fn("qw_paged_decode", k_cache.dtype)
    if fn is None or not _covered(q, k_cache, v_cache, block_tables, seq_lens, out) or not _sinks_covered(sinks, q):
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, **opts)
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    if seq_lens.shape[0] != B or block_tables.shape[0] < B:  # the kernel reads B of each
        raise ValueError(f"decode attention: {B} query rows but {seq_lens.shape[0]} sequence lengths and "
                         f"{block_tables.shape[0]} block-table rows")
    result = out if out is not None else torch.empty_like(q)
    if B == 0:
        return result
    # the kernel takes the tables' row stride, so a row slice of a wider table passes uncopied
    tables = block_tables.to(torch.int32)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    rc = fn(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), result.data_ptr(), result.stride(0), B, Hq, Hkv, D, block_size, float(scale), torch.get_num_threads(),
        k_cache.shape[0], _window_arg(sliding_window), float(softcap or 0.0), _sinks_arg(sinks),
    )
    if rc == -2:
        raise IndexError(f"a block table entry is outside the cache's {k_cache.shape[0]} blocks")
    if rc != 0:  # no scratch memory: the reference
        return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, **opts)
    return result


# False: paged_prefill_attention_cpu runs the torch reference (benchmarks compare the two); the
# environment's QWORKER_CPU_EXTEND=0 sets it at import
EXTEND_KERNEL = switch("QWORKER_CPU_EXTEND")


def paged_prefill_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    bf16_products: bool = False,
) -> torch.Tensor:
    """Same contract as :func:`kernels.reference.paged_prefill_attention_ref`: causal attention of
    each sequence's new query rows (any number, decode rows included) over its paged K/V, read in
    place by ``csrc/paged_extend.c`` (no gathered copy, no mask tensor). The reference runs instead
    for inputs the kernel does not cover (see :func:`_covered`) or with ``EXTEND_KERNEL`` off.

    ``bf16_products`` (the CPU bf16 mode), with a bf16 cache: the two products in bf16
    (``csrc/paged_extend_bf16_products.c``: queries and probabilities rounded to bf16, fp32 sums
    and softmax) on AMX tiles or AVX512_BF16 dot products, where the CPU has either (see
    :func:`extend_bf16_products_kernel`), else as without it."""
    opts = dict(out=out, sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    name = "qw_paged_extend_bf16_products" if bf16_products and k_cache.dtype == torch.bfloat16 else None
    fn = (getattr(_library(), name, None) if name else _cache_fn("qw_paged_extend", k_cache.dtype)) if EXTEND_KERNEL else None
    if (fn is None or not _covered(q, k_cache, v_cache, block_tables, seq_lens, out) or query_start_loc.device.type != "cpu"
            or not _sinks_covered(sinks, q)):
        return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                           max_query_len, **opts)
    T, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    result = out if out is not None else torch.empty_like(q)
    B = seq_lens.shape[0]
    if T == 0 or B == 0:
        return result
    tables = block_tables.to(torch.int32)
    if tables.stride(1) != 1:
        tables = tables.contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    rc = fn(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
        starts.data_ptr(), lens.data_ptr(), result.data_ptr(), result.stride(0), B, Hq, Hkv, D, block_size, float(scale),
        torch.get_num_threads(), k_cache.shape[0], _window_arg(sliding_window), float(softcap or 0.0), _sinks_arg(sinks),
    )
    if rc == -2:
        raise IndexError(f"a block table entry is outside the cache's {k_cache.shape[0]} blocks, or a sequence has more "
                         "query rows than tokens")
    if rc != 0:  # no scratch memory: the reference
        return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                           max_query_len, **opts)
    return result


def extend_bf16_products_kernel(head_dim: int) -> str | None:
    """What ``paged_prefill_attention_cpu(..., bf16_products=True)`` multiplies with for this head
    size: ``"amx"`` (the build has it, the OS grants AMX state), ``"avx512_bf16"`` (dot products),
    or None (head_dim % 32 != 0, or neither: the fp32-product kernel runs)."""
    fn = getattr(_library(), "qw_paged_extend_bf16_products_kernel", None) if _library() is not None else None
    return {2: "amx", 1: "avx512_bf16"}.get(fn(head_dim) if fn else 0)


def decode_bf16_products_kernel(head_dim: int, group: int, block_size: int) -> str | None:
    """What ``paged_decode_attention_cpu(..., bf16_products=True)`` over a bf16 cache multiplies
    with for this head size, query heads per KV head and page size: ``"amx"`` (the scores on AMX
    tiles: the OS grants AMX state, head_dim 64 or 128, group <= 16, an even page size),
    ``"avx512_bf16"`` (dot products, head_dim 64 or 128), or None (the fp32-product kernel)."""
    fn = getattr(_library(), "qw_paged_decode_bf16_dp_kernel", None) if _library() is not None else None
    return {2: "amx", 1: "avx512_bf16"}.get(fn(head_dim, group, block_size) if fn else 0)


def _sinks_covered(sinks: torch.Tensor | None, q: torch.Tensor) -> bool:
    """The kernels read attention sinks as a contiguous fp32 CPU vector, one per query head."""
    return sinks is None or (sinks.dtype == torch.float32 and sinks.device.type == "cpu" and sinks.is_contiguous()
                             and tuple(sinks.shape) == (q.shape[1],))


def _sinks_arg(sinks: torch.Tensor | None) -> int | None:
    return None if sinks is None else sinks.data_ptr()


def _window_arg(sliding_window: int | None) -> int:
    """The C kernel's window argument: 0 = off (a window reaching past int32 is off too)."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return min(sliding_window, 2**31 - 1)


def _covered(q, k_cache, v_cache, block_tables, seq_lens, out) -> bool:
    """Inputs the C kernel handles: fp32 queries and output, an fp32, fp16 or bf16 cache, on CPU, dense
    per-row layouts."""
    tensors = [q, k_cache, v_cache] + ([out] if out is not None else [])
    if any(t.device.type != "cpu" for t in tensors) or q.dtype != torch.float32 or v_cache.dtype != k_cache.dtype:
        return False
    if out is not None and out.dtype != torch.float32:
        return False
    if block_tables.device.type != "cpu" or seq_lens.device.type != "cpu":
        return False
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    rows_dense = [q] + ([out] if out is not None else [])
    heads_ok = q.shape[1] % k_cache.shape[2] == 0 and q.shape[2] % 8 == 0  # the kernel steps D by 8
    return heads_ok and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in rows_dense)


def rms_norm_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.reference.rms_norm_ref`: ``(out, x + residual)``, inputs
    untouched."""
    lib = _library()
    H = x.shape[-1]
    shapes_ok = weight.shape == (H,) and (residual is None or residual.shape == x.shape)
    if lib is not None and shapes_ok and x.dtype == torch.float32 and x.device.type == "cpu" and not x.is_contiguous():
        # a view (Gemma 3's q and k heads inside the fused qkv buffer): the kernel on a copy, as the
        # reference's reduction order depends on how many rows it is given (not batch-invariant)
        x = x.contiguous()
    inputs = [x, weight] + ([residual] if residual is not None else [])
    if lib is None or not shapes_ok or not all(_dense_fp32(t) for t in inputs):
        return rms_norm_ref(x, weight, eps, residual)
    new_residual = torch.empty_like(x)
    out = torch.empty_like(x)
    lib.qw_add_rms_norm_f32(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                            new_residual.data_ptr(), out.data_ptr(), x.numel() // H, H, float(eps), torch.get_num_threads())
    return out, new_residual


def rms_norm_bf16_out_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm_cpu` for the CPU bf16 mode's GEMM inputs: ``x`` fp32 or bf16 (a bf16 GEMM's
    output), ``residual`` and the returned ``x + residual`` fp32 (the residual stream keeps fp32),
    ``out`` bf16: the fp32 norm of ``x``'s fp32 values rounded once to bf16, as
    ``rms_norm_cpu(x.float(), ...)[0].to(torch.bfloat16)`` gives. Inputs untouched."""
    lib = _library()
    H = x.shape[-1]
    ok = (lib is not None and x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu" and x.is_contiguous()
          and weight.shape == (H,) and _dense_fp32(weight)
          and (residual is None or (residual.shape == x.shape and _dense_fp32(residual))))
    if not ok:
        out, new_residual = rms_norm_ref(x.float(), weight.float(), eps, None if residual is None else residual.float())
        return out.to(torch.bfloat16), new_residual
    new_residual = torch.empty(x.shape, dtype=torch.float32)
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    lib.qw_add_rms_norm_bf16out(x.data_ptr(), int(x.dtype == torch.bfloat16), residual.data_ptr() if residual is not None else None,
                                weight.data_ptr(), new_residual.data_ptr(), out.data_ptr(), x.numel() // H, H, float(eps),
                                torch.get_num_threads())
    return out, new_residual


def rotary_embedding_cpu_(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Same contract as :func:`kernels.reference.rotary_embedding_ref`: rotates ``q [T, Hq, D]``
    and ``k [T, Hk, D]`` in place. They may be views into one fused qkv row (same row stride)."""
    lib = _library()
    ok = (
        lib is not None
        and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, cos, sin))
        # one row stride serves both (fused qkv rows); with one row there is no second row, and a
        # size-1 dim's stride is arbitrary (a [1, 576] view of q reports 576, k's 192)
        and (q.shape[0] <= 1 or q.stride(0) == k.stride(0))
        and q.stride(1) == k.stride(1) == q.shape[2] and q.stride(2) == k.stride(2) == 1
        and cos.is_contiguous() and sin.is_contiguous() and positions.dtype == torch.int64 and positions.is_contiguous()
    )
    if not ok:
        rotary_embedding_ref(positions, q, k, cos, sin)
        return
    T, Hq, D = q.shape
    lib.qw_rope_f32(q.data_ptr(), k.data_ptr(), q.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                    T, Hq, k.shape[1], D, torch.get_num_threads())


def store_kv_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as :func:`kernels.reference.store_kv_ref`; ``key``/``value`` may be views
    into a fused qkv row (heads contiguous within a row)."""
    fn = _cache_fn("qw_store_kv", k_cache.dtype)
    ok = (
        fn is not None
        and v_cache.dtype == k_cache.dtype
        and all(t.dtype == torch.float32 for t in (key, value))
        and all(t.device.type == "cpu" for t in (key, value, k_cache, v_cache))
        and (key.shape[1] * key.shape[2]) % 8 == 0
        and k_cache.is_contiguous() and v_cache.is_contiguous()
        and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
        and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
        and k_cache.shape[2:] == key.shape[1:]
    )
    if not ok:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping)
        return
    T, Hkv, D = key.shape
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = fn(key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), T, Hkv * D, num_slots)
    if rc != 0:
        raise IndexError(f"a slot is outside the cache's {num_slots} slots")


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`kernels.reference.silu_and_mul_ref`; a bf16 ``gate_up`` (the CPU bf16
    mode's GEMM output) is computed in fp32 and rounded once to a bf16 result."""
    lib = _library()
    if gate_up.dtype == torch.bfloat16:
        return _silu_and_mul_bf16(lib, gate_up)
    if lib is None or not _dense_fp32(gate_up) or gate_up.dim() != 2:
        return silu_and_mul_ref(gate_up)
    T, two_i = gate_up.shape
    out = torch.empty((T, two_i // 2), dtype=gate_up.dtype)
    lib.qw_silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), T, two_i // 2, torch.get_num_threads())
    return out


def _silu_and_mul_bf16(lib, gate_up: torch.Tensor) -> torch.Tensor:
    if lib is None or gate_up.device.type != "cpu" or not gate_up.is_contiguous() or gate_up.dim() != 2:
        return silu_and_mul_ref(gate_up.float()).to(torch.bfloat16)
    T, two_i = gate_up.shape
    out = torch.empty((T, two_i // 2), dtype=torch.bfloat16)
    lib.qw_silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), T, two_i // 2, torch.get_num_threads())
    return out


def argmax_rows_cpu(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for fp32 or bf16 ``[rows, cols]`` CPU logits (rows contiguous), as
    int64: the first index of each row's maximum, or of its first NaN, like torch. Torch's argmax
    reduction runs at ~1 GB/s here (6.6 ms for 64 x 49152 fp32 on one core, 10 ms for 128 rows in
    bf16); this reads at memory speed."""
    lib = _library()
    if (lib is None or logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16)
            or logits.device.type != "cpu" or logits.stride(1) != 1 or logits.shape[1] == 0):
        return logits.argmax(dim=-1)
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    fn = lib.qw_argmax_rows_f32 if logits.dtype == torch.float32 else lib.qw_argmax_rows_bf16
    fn(logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def _dense_fp32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
