"""A plain decoder's whole layer loop in one C call (``csrc/decoder_layers.c``).

The Python loop calls ~10 kernel wrappers per layer, each a few to tens of microseconds of
argument checks, tensor allocations and ctypes conversion: at small decode batches that is more
than the kernels' own work (~6.5 ms of a 25 ms batch-1 step on the 2-vCPU AVX2 EPYC). Here the
layers' tensors are bound once (:class:`DecoderLayers`), each step's shared inputs are checked
once, and the C loop calls the same kernels with the same arguments, so the results are bit for
bit the Python loop's (``tests/engine/test_fused_cpu_forward.py`` holds it to that).

Covered: panels-packed fp32 weights with fp32 activations (``DecoderModel.forward``) or bf16
weights in the CPU bf16 mode (``DecoderModel._forward_cpu_bf16``: bf16 GEMM inputs and outputs,
fp32 residual stream, rotary and attention), an fp32 / bf16 / fp16 paged cache (fp16
where the build has F16C), the C extend kernel for prefill rows (``kernels.cpu.EXTEND_KERNEL``),
rotary over whole heads, SwiGLU. :meth:`DecoderLayers.run` returns None for anything else, and
the caller runs its Python loop (which falls back kernel by kernel).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from . import cpu as _cpu
from . import gemm_cpu

_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_CACHE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class _Form(NamedTuple):
    layers: str  # the C loop
    gemm: str  # the GEMM it is given (from the chosen GEMM build)


# by the packed weights' dtype
_FORMS = {torch.float32: _Form("qw_decoder_layers_f32", "qw_gemm_f32"),
          torch.bfloat16: _Form("qw_decoder_layers_bf16", "qw_gemm_bf16")}


class _Layer(ctypes.Structure):
    _fields_ = [*((name, _P) for name in ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up", "down",
                                           "k_cache", "v_cache")),
                ("qkv_bias_bf16", _I32), ("o_bias_bf16", _I32)]


class _Step(ctypes.Structure):
    _fields_ = [
        ("T", _I64), ("H", _I32), ("Hq", _I32), ("Hkv", _I32), ("D", _I32), ("I", _I32),
        ("eps", _F32), ("scale", _F32), ("softcap", _F32), ("window", _I32), ("threads", _I32),
        ("cache_dtype", _I32), ("block_size", _I32), ("num_blocks", _I64),
        ("positions", _P), ("slots", _P), ("cos", _P), ("sin", _P),
        ("tables", _P), ("seq_lens", _P), ("query_start_loc", _P), ("table_stride", _I64),
        ("num_decodes", _I32), ("num_seqs", _I32), ("gemm", _P),
        ("emb", _P), ("res", _P * 2), ("qkv", _P), ("attn", _P), ("h", _P), ("x", _P), ("gu", _P), ("act", _P),
        ("attn_bf16", _P), ("bf16_products", _I32), ("swiglu", _P),
    ]


def _fp32(t: torch.Tensor | None) -> bool:
    return t is None or _cpu._dense_fp32(t)


def _bias_ok(t: torch.Tensor | None, weight_dtype: torch.dtype) -> bool:
    """fp32, or bf16 beside bf16 weights (the bf16 GEMM reads either)."""
    if t is None or weight_dtype == torch.float32:
        return _fp32(t)
    return t.dtype in (torch.float32, torch.bfloat16) and t.device.type == "cpu" and t.is_contiguous()


def _is_bf16(t: torch.Tensor | None) -> int:
    return int(t is not None and t.dtype == torch.bfloat16)


class DecoderLayers:
    """The layers of one model, bound for :meth:`run`. ``layers``: per layer a dict with
    ``input_norm``, ``post_norm`` ``[H]`` (fp32) and the packed projections ``qkv`` (``[*, H, 16]``,
    with ``qkv_bias`` or None), ``o`` (with ``o_bias``), ``gate_up``, ``down``, all fp32 (the fp32
    form) or all bf16 (the CPU bf16 mode's form; all in the panels layout or all in the amx one,
    ``[*, K / 2, 32]``, whose GEMM is then ``csrc/gemm_amx.c``'s); the tensors must outlive this object (it keeps
    references). Shapes: ``H`` hidden, ``Hq``/``Hkv`` heads of ``D``, ``I`` the MLP's
    intermediate size."""

    def __init__(self, layers: list[dict], H: int, Hq: int, Hkv: int, D: int, I: int, eps: float, scale: float,
                 window: int | None, softcap: float | None, cos: torch.Tensor, sin: torch.Tensor,
                 bf16_products: bool = False):
        self.H, self.Hq, self.Hkv, self.D, self.I = H, Hq, Hkv, D, I
        self.W = (Hq + 2 * Hkv) * D
        self.eps, self.scale = float(eps), float(scale)
        self.window = _cpu._window_arg(window)
        self.softcap = float(softcap or 0.0)
        self.cos, self.sin = cos, sin
        self.bf16_products = bool(bf16_products)  # PagedAttention's: the extend kernel's AMX form
        self._tensors = layers  # kept alive: the structs hold their addresses
        self.weight_dtype = layers[0]["qkv"].dtype if layers else torch.float32
        # bf16 weights packed for AMX (kernels/gemm_cpu.py): every projection, or none
        self.amx = bool(layers) and gemm_cpu.is_amx_packed(layers[0]["qkv"])
        self.ok = self.weight_dtype in _FORMS and self._check(layers)
        self._weights = [{**{name: (t.data_ptr() if t is not None else None) for name, t in layer.items()},
                          "qkv_bias_bf16": _is_bf16(layer["qkv_bias"]), "o_bias_bf16": _is_bf16(layer["o_bias"])}
                         for layer in layers]
        self._bound: tuple | None = None  # (the caches' addresses, the ctypes array of layers)

    def _check(self, layers: list[dict]) -> bool:
        H, W, I, Q = self.H, self.W, self.I, self.Hq * self.D
        want = {"qkv": (H, W), "o": (Q, H), "gate_up": (H, 2 * I), "down": (I, H)}  # (K, N) of each GEMM
        for layer in layers:
            for name, (K, N) in want.items():
                p = layer[name]
                shape = (K // 2, 2 * gemm_cpu.NR) if self.amx else (K, gemm_cpu.NR)
                if not (p.dtype == self.weight_dtype and p.dim() == 3 and p.shape[1:] == shape
                        and gemm_cpu.is_amx_packed(p) == self.amx and (not self.amx or K % gemm_cpu.AMX_K == 0)
                        and p.shape[0] == -(-N // gemm_cpu.NR) and p.is_contiguous() and p.device.type == "cpu"):
                    return False
            if not (_fp32(layer["input_norm"]) and _fp32(layer["post_norm"])
                    and _bias_ok(layer["qkv_bias"], self.weight_dtype) and _bias_ok(layer["o_bias"], self.weight_dtype)):
                return False
            if layer["input_norm"].shape != (H,) or layer["post_norm"].shape != (H,):
                return False
            for bias, n in (("qkv_bias", W), ("o_bias", H)):
                if layer[bias] is not None and layer[bias].shape != (n,):
                    return False
        return (self.Hq % self.Hkv == 0 and self.D % 8 == 0 and _fp32(self.cos) and _fp32(self.sin)
                and self.cos.shape == self.sin.shape and self.cos.dim() == 2 and self.cos.shape[1] == self.D)

    def _layer_array(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        # keyed by the caches' addresses, which are exactly what the array holds: it is only used
        # while the caller's caches (alive for the call) sit at those addresses
        key = tuple((k.data_ptr(), v.data_ptr()) for k, v in kv_caches)
        if self._bound is None or self._bound[0] != key:
            arr = (_Layer * len(self._weights))()
            for slot, w, (k, v) in zip(arr, self._weights, kv_caches):
                for name, value in w.items():
                    setattr(slot, name, value)
                slot.k_cache, slot.v_cache = k.data_ptr(), v.data_ptr()
            self._bound = (key, arr)
        return self._bound[1]

    def run(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
            query_start_loc: torch.Tensor, num_decodes: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer over ``h`` ``[T, H]`` (the embeddings, fp32; not modified): ``(h, residual)``
        as the Python loop leaves them after the last layer (both fp32: the bf16 form's last MLP
        output is widened, which is exact), or None where this path does not cover the
        inputs (checked before anything is written) or a kernel ran out of scratch memory (the
        caller's loop then starts over, rewriting the same K/V rows). Raises IndexError for a slot
        or block-table entry outside the cache, as the kernels' wrappers do."""
        form = _FORMS.get(self.weight_dtype)
        lib = _cpu._library()
        fn = getattr(lib, form.layers, None) if lib is not None and form else None
        gemm_lib = gemm_cpu._gemm_library(self.weight_dtype)
        gemm_name = "qw_gemm_bf16_amx" if self.amx else form.gemm if form else None
        gemm = getattr(gemm_lib, gemm_name, None) if gemm_lib is not None and gemm_name else None
        if self.amx and not gemm_cpu.amx_layout_usable(gemm_lib):
            gemm = None
        # the gate/up GEMM with SwiGLU in its epilogue (the same bits; it declines where AMX is absent)
        swiglu = getattr(gemm_lib, "qw_gemm_bf16_amx_swiglu", None) if self.amx and gemm is not None else None
        T = h.shape[0] if h.dim() == 2 else 0
        if fn is None or gemm is None or not self.ok or T == 0 or not _cpu.EXTEND_KERNEL or len(kv_caches) != len(self._weights):
            return None
        k0, v0 = kv_caches[0]
        dtype = _CACHE_DTYPES.get(k0.dtype)
        if (dtype is None or not _fp32(h) or h.shape[1] != self.H
                or k0.dim() != 4 or k0.shape[2:] != (self.Hkv, self.D)
                or any(k.dtype != k0.dtype or v.dtype != k0.dtype or k.shape != k0.shape or v.shape != k0.shape
                       or k.device.type != "cpu" or v.device.type != "cpu" or not k.is_contiguous() or not v.is_contiguous()
                       for k, v in kv_caches)):
            return None
        if not (_int_vector(positions, torch.int64, T) and _int_vector(slot_mapping, torch.int64, T)):
            return None
        B = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
        if not (_int_vector(seq_lens, torch.int32, B) and _int_vector(query_start_loc, torch.int32, B + 1)
                and block_tables.dtype == torch.int32 and block_tables.device.type == "cpu" and block_tables.dim() == 2
                and block_tables.shape[0] == B and (B == 0 or block_tables.stride(1) == 1)
                and 0 <= num_decodes <= min(B, T)):
            return None
        # the decode rows are [0, num_decodes) and the extend rows end at T: the kernels index the
        # step's buffers by these, so metadata that disagrees with T is the Python loop's to refuse
        if int(query_start_loc[num_decodes]) != num_decodes or int(query_start_loc[-1]) != T:
            return None
        extend_starts = query_start_loc[num_decodes:] - num_decodes  # the extend rows', from 0 (int32)
        sizes = [T * n for n in (self.H, self.H, self.W, self.Hq * self.D)]
        res0, res1, qkv, attn = torch.split(torch.empty(sum(sizes), dtype=torch.float32), sizes)
        bf16 = self.weight_dtype == torch.bfloat16
        sizes = [T * n for n in (self.H, self.H, 2 * self.I, self.I, self.Hq * self.D * bf16)]  # the weights' dtype
        out_h, x, gu, act, attn_bf16 = torch.split(torch.empty(sum(sizes), dtype=self.weight_dtype), sizes)
        h = h.contiguous()
        s = _Step(T=T, H=self.H, Hq=self.Hq, Hkv=self.Hkv, D=self.D, I=self.I, eps=self.eps, scale=self.scale,
                  softcap=self.softcap, window=self.window, threads=torch.get_num_threads(), cache_dtype=dtype,
                  block_size=k0.shape[1], num_blocks=k0.shape[0], positions=positions.data_ptr(),
                  slots=slot_mapping.data_ptr(), cos=self.cos.data_ptr(), sin=self.sin.data_ptr(),
                  tables=block_tables.data_ptr(), seq_lens=seq_lens.data_ptr(), query_start_loc=extend_starts.data_ptr(),
                  table_stride=block_tables.stride(0) if B else 0, num_decodes=num_decodes, num_seqs=B,
                  gemm=ctypes.cast(gemm, _P).value, emb=h.data_ptr(), qkv=qkv.data_ptr(), attn=attn.data_ptr(),
                  h=out_h.data_ptr(), x=x.data_ptr(), gu=gu.data_ptr(), act=act.data_ptr(),
                  attn_bf16=attn_bf16.data_ptr() if bf16 else None, bf16_products=int(self.bf16_products),
                  swiglu=ctypes.cast(swiglu, _P).value if swiglu is not None else None)
        s.res[0], s.res[1] = res0.data_ptr(), res1.data_ptr()
        rc = fn(self._layer_array(kv_caches), len(self._weights), ctypes.byref(s))
        if rc == -1:
            raise IndexError(f"a slot is outside the cache's {k0.shape[0] * k0.shape[1]} slots")
        if rc == -2:
            raise IndexError(f"a block table entry is outside the cache's {k0.shape[0]} blocks")
        if rc != 0:
            return None
        return out_h.view(T, self.H).float(), res1.view(T, self.H)


def _int_vector(t: torch.Tensor, dtype: torch.dtype, n: int) -> bool:
    return t.dtype == dtype and t.device.type == "cpu" and t.dim() == 1 and t.shape[0] == n and t.is_contiguous()
