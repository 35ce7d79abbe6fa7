"""The model's projections (``y = x @ W.T + b``) and the GEMM path each one runs on.

Four paths:

* ``"transposed"`` (CUDA): ``x @ w`` with ``w`` the free transposed view of the checkpoint's
  ``[out, in]`` weight, which cuBLAS takes as is. The CUDA path is exactly what it always was.
* ``"onednn"`` (CPU, where panels does not run and it wins): the weight is reordered once, at load, into oneDNN's
  blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) and every call is one
  ``torch.ops.mkldnn._linear_pointwise`` (bias fused). This is what inductor emits for a frozen
  linear and what vLLM's CPU backend does through its own oneDNN bindings. oneDNN accumulates in
  fp32 like MKL's sgemm, so fp32 results match the other paths up to rounding. Measured on the
  2-core development VM (AMD EPYC, AVX2), the model's 30 layers plus the LM head: 2.4x faster than
  ``x @ w`` at 8 rows, 2.0x at 16, 1.8x at 32, 1.5x at 64, 1.2x at 128, 1.05-1.1x at 256-1024.
  One packing (``batch_size_hint=None``) serves every row count: hints of 16, 64, 256 or 512
  moved 1-16 rows by less than the noise and larger batches by under 10% (either way); a hint of 1
  was 1.4-1.5x slower at 8-32 rows.
* ``"panels"`` (the CPU default, fp32 or bf16 weights): qworker's own GEMM (:mod:`kernels.gemm_cpu`,
  ``csrc/gemm_f32.c`` and ``csrc/gemm_bf16.c``): the weight packed once into 16-column panels, an
  AVX2+FMA micro-kernel (on AVX-512 CPUs also an AVX-512 one, weighed against it at start-up by
  ``gemm_cpu.choose_gemm_isa``). It exists for decode batches (1-128 rows: 1.3-1.8x oneDNN on the 2-core AVX2 VM, about
  even on prefill chunks), where oneDNN's small-M GEMMs run well below both the weight-streaming
  floor and the FMA peak, and for its per-call cost (one ctypes call, no primitive lookup). fp32
  results match the other paths up to rounding (a different summation order). bf16 weights are
  widened to fp32 in registers (bf16 x in, fp32 sums, bf16 out, as oneDNN's bf16 linear), so the
  CPU bf16 mode needs no bf16 GEMM hardware and streams half the bytes: 1.6-2x the fp32 panels at
  1-4 rows, level from 16 rows (the FMAs are then the limit). Where the CPU has AVX512_BF16, bf16
  x goes to a dot-product kernel instead (VDPBF16PS: twice the multiply-adds per instruction).
* ``"matmul"`` (the CPU fallback): ``x @ w`` with ``w`` a materialised row-major ``[in, out]``
  copy (for 8-64 rows MKL's sgemm is 2-4x faster with it than with ``F.linear``'s transposed
  operand).

:func:`cpu_linear_backend` chooses among the CPU paths once per process and dtype: panels wherever
it runs (fp32 or bf16 weights and the compiled C kernels), because its sums run in one fixed order
per output: a row's result does not depend on how many rows its step has, nor on the machine's
timing, nor on which ISA build runs it (the AVX-512 and AVX2 fp32 builds give the same bits). That
is what makes speculative decoding give exactly the tokens without it, a job's tokens independent of
the jobs batched with it, and every pod of a deployment give the same answer. Without panels,
oneDNN (the private ops, a dtype its build supports on this CPU, and a result that equals the
reference on a small check) and x @ w time a few of the model's own layers at decode- and
prefill-sized inputs (one thread, its CPU time: see :func:`measure_backends`), and oneDNN is taken
unless clearly slower. ``QWORKER_CPU_LINEAR=panels``, ``=onednn`` or ``=matmul`` forces a path (an
unavailable one then raises).
"""

from __future__ import annotations

import logging
import os
import statistics
import time

import torch

from kernels import gemm_cpu

log = logging.getLogger(__name__)

BACKENDS = ("panels", "onednn", "matmul")  # also the order of preference, see _prefer
PANELS_DTYPES = (torch.float32, torch.bfloat16)
# rows timed by the start-up comparison (summed): decode batches of 1, 16 and 48 and a prefill chunk.
# Decode steps are most of a run's time (a 48-request run is ~80% decode, much of it at small,
# shrinking batches); probing 16 and 128 rows only let the prefill chunk decide, and on Sapphire
# Rapids picked oneDNN's bf16 linear (1.18x the AMX panels GEMM there) while the panels GEMM and
# the one-call layer loop it enables ran the 48-request run 1.38x as fast (docs/benchmarks.md)
_PROBE_ROWS = (1, 16, 48, 128)
# where panels does not run, oneDNN is kept over x @ w unless it is this much slower: measurement
# noise on a shared machine must not flip the choice (and the float rounding that comes with it)
# from run to run. (Panels is not timed: a probe of single calls could not see what it saves a
# plain decoder beyond its GEMMs, the one-call layer loop. When it was timed, on Sapphire Rapids its
# bf16 probe came out even to 1.18x for oneDNN while it ran the 48-request run 1.38x as fast.)
_KEEP_PREFERRED_UNLESS_SLOWER = 1.3
_choices: dict[tuple, str] = {}


class Linear:
    """One projection, called as ``linear(x)`` with ``x`` ``[T, in]`` -> ``[T, out]``.

    With ``act_dtype`` (the CPU bf16 mode: bf16 weights, fp32 activations) the input is rounded to
    the weight's dtype for the GEMM (fp32 accumulation) and the output returned in ``act_dtype``."""

    __slots__ = ("backend", "in_features", "out_features", "weight", "bias", "act_dtype")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, backend: str, act_dtype: torch.dtype | None = None):
        """``weight``: ``[out, in]`` as checkpoints store it; it is kept only in the path's layout."""
        self.backend = backend
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.act_dtype = act_dtype if act_dtype is not None and act_dtype != weight.dtype else None
        if backend == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        elif backend == "panels":
            if weight.dtype not in PANELS_DTYPES:
                raise ValueError(f"the panels linear backend takes float32 or bfloat16 weights, not {weight.dtype}")
            self.weight = gemm_cpu.pack_weight(weight)  # bf16 stays bf16: half the bytes to stream
        elif backend == "matmul":
            self.weight = weight.t().contiguous()
        elif backend == "transposed":
            self.weight = weight.t()
        else:
            raise ValueError(f"unknown linear backend {backend!r}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_dtype is not None:
            return self._gemm(x.to(self.weight.dtype)).to(self.act_dtype)
        return self._gemm(x)

    def lowp(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x)`` without the conversion back: the output in the weight's dtype, for a consumer
        that reads it (the CPU bf16 mode's C kernels). The GEMM rounds its output to that dtype
        either way, so the values are exactly ``self(x)``'s; an ``x`` already in the weight's dtype
        is not converted."""
        return self._gemm(x if x.dtype == self.weight.dtype else x.to(self.weight.dtype))

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.backend == "panels":
            return gemm_cpu.gemm(x, self.weight, self.bias, self.out_features)
        y = x @ self.weight
        if self.bias is not None:
            y += self.bias
        return y

    def dense_out_in(self) -> torch.Tensor:
        """The weight as a plain ``[out, in]`` tensor (a copy for the CPU paths)."""
        if self.backend == "onednn":
            return self.weight.to_dense()
        if self.backend == "panels":
            return gemm_cpu.unpack_weight(self.weight, self.out_features)
        return self.weight.t()


def onednn_supported(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether oneDNN's packed linear runs here for ``dtype``, and why not."""
    if not torch.backends.mkldnn.is_available():
        return False, "torch is built without oneDNN (mkldnn)"
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False, "this torch build lacks mkldnn::_reorder_linear_weight / _linear_pointwise"
    if dtype not in (torch.float32, torch.bfloat16):
        return False, f"oneDNN linear is used for float32 and bfloat16 only, not {dtype}"
    if dtype == torch.bfloat16 and not bf16_gemm_hardware():
        return False, "oneDNN would emulate bf16 GEMMs here (the CPU has neither AVX512_BF16 nor AMX)"
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen)
    b = torch.randn(48, generator=gen)
    x = torch.randn(5, 40, generator=gen)
    try:
        with torch.inference_mode():
            packed = ops._reorder_linear_weight(w.to(dtype), None)
            y = ops._linear_pointwise(x.to(dtype), packed, b.to(dtype), "none", [], "").float()
    except RuntimeError as exc:  # e.g. bf16 without AVX512-BF16/AVX-NE-CONVERT support
        return False, str(exc).splitlines()[0]
    ref = x.to(dtype).float() @ w.to(dtype).float().t() + b.to(dtype).float()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    if not torch.allclose(y, ref, rtol=tol, atol=tol):
        return False, "oneDNN linear gave wrong results on the start-up check"
    return True, ""


def bf16_gemm_hardware() -> list[str]:
    """The CPU's bf16 dot-product features oneDNN's bf16 kernels need (empty: it would emulate)."""
    cpu = torch.cpu
    return [name for name, probe in (("AVX512_BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
            if getattr(cpu, probe, lambda: False)()]


def check_cpu_bf16() -> None:
    """``dtype="bfloat16"`` on CPU needs a bf16 GEMM that is not emulated: qworker's own panels
    GEMM (bf16 weights widened in registers, fp32 FMAs: any CPU the C kernels build for), or
    oneDNN's bf16 linear on bf16 GEMM hardware (AVX512_BF16 or AMX). Anywhere else bf16 GEMMs are
    emulated and several times slower than fp32, so this raises a ValueError saying so.
    ``QWORKER_CPU_BF16=force`` skips the check (tests, or to measure the slow path)."""
    if os.environ.get("QWORKER_CPU_BF16") == "force":
        return
    panels_ok, panels_why = panels_supported(torch.bfloat16)
    if panels_ok:
        return
    hw = bf16_gemm_hardware()
    ok, why = onednn_supported(torch.bfloat16)
    if hw and ok:
        return
    detail = why if hw else f"this CPU has neither AVX512_BF16 nor AMX (torch's CPU capability: {torch.backends.cpu.get_cpu_capability()})"
    raise ValueError(f"dtype='bfloat16' on CPU needs qworker's panels GEMM ({panels_why}) or bf16 GEMM hardware (AVX512_BF16 or AMX) "
                     f"and oneDNN's bf16 linear: {detail}. "
                     "Use dtype='float32' (the CPU default); kv_cache_dtype='bfloat16' or 'float16' still halves the KV cache.")


def panels_supported(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether qworker's own GEMM runs here for ``dtype`` weights, and why not."""
    if dtype not in PANELS_DTYPES:
        return False, f"the panels GEMM takes float32 or bfloat16 weights, not {dtype}"
    why = gemm_cpu.self_check(dtype)
    return not why, why


def available_backends(dtype: torch.dtype) -> dict[str, str]:
    """Each CPU path for ``dtype`` -> "" where it runs here, else why it does not."""
    return {"panels": panels_supported(dtype)[1], "onednn": onednn_supported(dtype)[1], "matmul": ""}


def cpu_linear_backend(dtype: torch.dtype, sample: list[torch.Tensor]) -> str:
    """The CPU GEMM path for this dtype: forced by ``QWORKER_CPU_LINEAR``, else measured once per
    process on ``sample`` (some of the model's ``[out, in]`` weights) and remembered."""
    forced = os.environ.get("QWORKER_CPU_LINEAR", "auto")
    if forced not in ("auto", *BACKENDS):
        raise ValueError(f"QWORKER_CPU_LINEAR must be auto, {', '.join(BACKENDS)}; got {forced!r}")
    if dtype == torch.float32:  # on AVX-512 CPUs: its own GEMM micro-kernel or AVX2's, measured once
        gemm_cpu.choose_gemm_isa(sample)
    why_not = available_backends(dtype)
    if forced != "auto":
        if why_not[forced]:
            raise RuntimeError(f"QWORKER_CPU_LINEAR={forced}, but that path is unavailable: {why_not[forced]}")
        return forced
    usable = tuple(b for b in BACKENDS if not why_not[b])
    if "panels" in usable:  # batch-invariant and deterministic: see the module's docstring
        return "panels"
    if len(usable) == 1:
        log.info("CPU linear layers: x @ w (%s)", "; ".join(f"{b}: {w}" for b, w in why_not.items() if w))
        return usable[0]
    key = (dtype, tuple(tuple(w.shape) for w in sample), usable)
    if key not in _choices:
        times = measure_backends(dtype, sample, backends=usable)
        choice = _prefer(times)
        log.info("CPU linear layers: %s (start-up check: %s)", choice, ", ".join(f"{b} {t * 1e3:.2f} ms" for b, t in times.items()))
        _choices[key] = choice
    return _choices[key]


def _prefer(times: dict[str, float]) -> str:
    """The first path, in BACKENDS order, within _KEEP_PREFERRED_UNLESS_SLOWER of the fastest."""
    fastest = min(times.values())
    return next(b for b in BACKENDS if b in times and times[b] <= _KEEP_PREFERRED_UNLESS_SLOWER * fastest)


def measure_backends(dtype: torch.dtype, sample: list[torch.Tensor], rows=_PROBE_ROWS, rounds: int = 3,
                     backends: tuple[str, ...] = ("onednn", "matmul")) -> dict[str, float]:
    """Median seconds, per path in ``backends``, of one pass of every weight in ``sample`` at each
    row count (summed over the row counts); the paths alternate round by round.

    Timed on one thread with that thread's CPU time: on a shared machine a multi-threaded
    wall-clock probe measures the other processes (a 2-thread oneDNN or MKL call whose partner
    thread is preempted waits a scheduler slice at each barrier: probes of 2 ms took 2-300 ms at a
    load average of 8 and picked either path at random), while one thread's CPU time gave the
    same answer run after run (bf16 on AMX: oneDNN 2.4-2.7 ms, x @ w 3.3-3.5 ms)."""
    layers = {b: [Linear(w.to(dtype), None, b) for w in sample] for b in backends}
    gen = torch.Generator().manual_seed(0)
    inputs = {(r, n): torch.randn(r, n, generator=gen).to(dtype) for r in rows for n in {w.shape[1] for w in sample}}
    times: dict[str, list[float]] = {b: [] for b in backends}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _time_backends(layers, inputs, rows, rounds, times)
    finally:
        torch.set_num_threads(threads)
    return {b: statistics.median(t) for b, t in times.items()}


def _time_backends(layers: dict, inputs: dict, rows, rounds: int, times: dict[str, list[float]]) -> None:
    with torch.inference_mode():
        for b in layers:  # warm-up: first calls create oneDNN primitives
            for r in rows:
                for lin in layers[b]:
                    lin(inputs[r, lin.in_features])
        for _ in range(rounds):
            for b in layers:
                start = time.thread_time()
                for r in rows:
                    for lin in layers[b]:
                        lin(inputs[r, lin.in_features])
                times[b].append(time.thread_time() - start)
