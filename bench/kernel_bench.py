"""Time the paged-KV kernels against their torch references and the copy bandwidth.

On CUDA (the real run, called by bench/gpu_check.sh):
    python bench/kernel_bench.py --json bench/results/kernel_bench.json
On a CPU-only machine, ``--dry-run`` runs every code path on tiny shapes under
Triton's interpreter (timings meaningless) so the script is known to work
before it reaches a GPU:
    python bench/kernel_bench.py --dry-run

Decode attention is memory-bound: its figure of merit is the bytes of K/V it
must read (each live token's K and V once) over its time, against the card's
device-to-device copy bandwidth (bytes read + written per second). Prefill is
reported in TFLOP/s of causal attention, store_kv and rms_norm in GB/s.

Multi-LoRA shrink/expand ("lora:shrink", "lora:expand") are timed on a Llama-3-8B-shaped fused qkv
projection (rank 16, 4 adapters, bf16) at decode (segments sorted by adapter, and one row per
segment) and prefill, in GB/s of the activations, LoRA weights and outputs they must move;
``bench/gpu_check.sh`` runs them as their own step (``--only lora``).

Sliding-window (and softcapped) attention is timed on the same kernels with the
options on ("decode:window", "prefill:window"): decode's bytes are those of the
window only (what it must read), and ``full_ms`` is the same shape without the
window, so ``full_ms / ms`` shows what skipping the blocks outside it saves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


PARTS = ("decode", "prefill", "window", "store_kv", "rms_norm", "moe", "lora")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes, CPU interpreter if no CUDA")
    p.add_argument("--json", type=Path, default=None, help="where to write all figures")
    p.add_argument("--no-sweep", action="store_true", help="time only the default decode config")
    p.add_argument("--summary", type=Path, default=None, help="print the table of an existing JSON and exit")
    p.add_argument("--only", default="", help=f"comma-separated parts to run (default all): {','.join(PARTS)}")
    p.add_argument("--skip", default="", help="comma-separated parts not to run")
    return p.parse_args()


ARGS = _parse()
if ARGS.summary is None and (ARGS.dry_run or os.environ.get("CUDA_VISIBLE_DEVICES") == ""):
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DRY = ARGS.dry_run or not torch.cuda.is_available()
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels' triton modules are imported
DEV = torch.device("cpu" if DRY else "cuda")

import kernels  # noqa: E402


# ---------------------------------------------------------------- timing
def bench_ms(fn) -> float:
    """Median milliseconds: triton's do_bench (CUDA events, L2 flushed) on GPU,
    a few wall-clock runs in dry-run mode."""
    if DRY:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth() -> dict:
    """Device-to-device copy of a buffer far larger than L2: (read + write) bytes / time."""
    n = (2 << 20) if DRY else (1 << 30)  # bytes per buffer: 1 GiB on the GPU
    src = torch.randn(n // 4, device=DEV)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return {"bytes_per_copy": 2 * n, "ms": ms, "GBps": 2 * n / ms / 1e6}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ---------------------------------------------------------------- inputs
def paged_inputs(B: int, ctx: int, q_len: int, Hq: int, Hkv: int, D: int, dtype, block_size: int = 16):
    """A batch of B sequences of ``ctx`` tokens over shuffled pages; the last
    ``q_len`` tokens of each are the queries. Random data, never zeros."""
    nb_seq = math.ceil(ctx / block_size)
    num_blocks = B * nb_seq + 8
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, device=DEV, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=DEV)[: B * nb_seq]
    block_tables = perm.view(B, nb_seq).to(torch.int32)
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    qsl = torch.arange(0, (B + 1) * q_len, q_len, dtype=torch.int32, device=DEV)
    q = torch.randn(B * q_len, Hq, D, device=DEV, dtype=dtype)
    return q, k_cache, v_cache, block_tables, qsl, seq_lens


# ---------------------------------------------------------------- kernels
def bench_decode(copy_gbps: float, sweep: bool) -> list[dict]:
    if DRY:
        cases = [(2, 100, 4, 2, 64)]
        configs = [dict(block_n=16)]
    else:
        # (B, ctx, Hq, Hkv, D): the issue's two shapes at head dim 64 and 128, plus SmolLM2's heads.
        cases = [(64, 2048, 32, 8, 128), (8, 32768, 32, 8, 128), (64, 2048, 32, 8, 64), (8, 32768, 32, 8, 64),
                 (64, 2048, 9, 3, 64)]
        configs = [dict(block_n=64, num_warps=4, num_stages=2)]
        if sweep:
            configs += [dict(block_n=n, num_warps=w, num_stages=s) for n, w, s in
                        [(32, 4, 2), (128, 4, 2), (64, 8, 2), (128, 8, 3), (64, 4, 3)]]
    dtype = torch.float32 if DRY else torch.bfloat16
    rows = []
    for B, ctx, Hq, Hkv, D in cases:
        q, kc, vc, bt, _, lens = paged_inputs(B, ctx, 1, Hq, Hkv, D, dtype)
        scale = D ** -0.5
        kv_bytes = 2 * B * ctx * Hkv * D * kc.element_size()
        ref_out = kernels.paged_decode_attention_ref(q, kc, vc, bt, lens, scale)
        ref_ms = bench_ms(lambda: kernels.paged_decode_attention_ref(q, kc, vc, bt, lens, scale))
        best = None
        for cfg in configs:
            for splits in ([None] if DRY or not sweep else [None, "x2"]):
                ns = None
                if splits == "x2":
                    from kernels.decode_attention import choose_num_splits
                    ns = 2 * choose_num_splits(B, Hkv, bt.shape[1] * kc.shape[1], cfg["block_n"], q.device)
                out = kernels.paged_decode_attention(q, kc, vc, bt, lens, scale, ns, **cfg)
                err = rel_err(out, ref_out)
                ms = bench_ms(lambda: kernels.paged_decode_attention(q, kc, vc, bt, lens, scale, ns, **cfg))
                row = dict(kernel="decode", B=B, ctx=ctx, Hq=Hq, Hkv=Hkv, D=D, dtype=str(dtype), config=cfg,
                           num_splits=ns or "auto", ms=ms, ref_ms=ref_ms, kv_bytes=kv_bytes,
                           GBps=kv_bytes / ms / 1e6, frac_copy_bw=kv_bytes / ms / 1e6 / copy_gbps, rel_err=err)
                rows.append(row)
                if best is None or ms < best["ms"]:
                    best = row
        rows.append({**best, "kernel": "decode:best"})
        del q, kc, vc
    return rows


def bench_prefill() -> list[dict]:
    if DRY:
        cases = [(2, 40, 20, 4, 2, 64)]
        kw = dict(block_m=16, block_n=16)
    else:
        # (B, ctx, q_len, Hq, Hkv, D): whole prompts, and chunks after a cached prefix
        cases = [(4, 2048, 2048, 32, 8, 128), (4, 4096, 512, 32, 8, 128), (16, 512, 512, 9, 3, 64)]
        kw = {}
    dtype = torch.float32 if DRY else torch.bfloat16
    rows = []
    for B, ctx, ql, Hq, Hkv, D in cases:
        q, kc, vc, bt, qsl, lens = paged_inputs(B, ctx, ql, Hq, Hkv, D, dtype)
        scale = D ** -0.5
        args = (q, kc, vc, bt, qsl, lens, scale, ql)
        prefix = ctx - ql
        attended = B * sum(prefix + i + 1 for i in range(ql))  # keys per query row, causal
        flops = 4 * attended * Hq * D  # QK^T and PV, 2 flops per MAC
        err = rel_err(kernels.paged_prefill_attention(*args, **kw), kernels.paged_prefill_attention_ref(*args))
        ms = bench_ms(lambda: kernels.paged_prefill_attention(*args, **kw))
        ref_ms = bench_ms(lambda: kernels.paged_prefill_attention_ref(*args))
        rows.append(dict(kernel="prefill", B=B, ctx=ctx, q_len=ql, Hq=Hq, Hkv=Hkv, D=D, dtype=str(dtype), ms=ms,
                         ref_ms=ref_ms, TFLOPs=flops / ms / 1e9, rel_err=err))
    return rows


def bench_window(copy_gbps: float) -> list[dict]:
    """Decode and prefill with a sliding window (and Gemma 2's softcap) against the same shapes
    without them and against the references with them."""
    if DRY:
        dec_cases = [(2, 100, 4, 2, 64, 37, 50.0)]
        pre_cases = [(2, 40, 20, 4, 2, 64, 13, 50.0)]
        kw = dict(block_m=16, block_n=16)
    else:
        # (B, ctx, Hq, Hkv, D, window, softcap): Mistral-like (4k window of a 32k context),
        # Gemma 2-like (D 256, softcap 50), Gemma 3 270M's local layers (window 512)
        dec_cases = [(8, 32768, 32, 8, 128, 4096, None), (32, 8192, 16, 8, 256, 4096, 50.0),
                     (64, 4096, 4, 1, 256, 512, None)]
        # (B, ctx, q_len, Hq, Hkv, D, window, softcap): whole prompts and a chunk after a prefix
        pre_cases = [(2, 8192, 8192, 32, 8, 128, 4096, None), (4, 4096, 4096, 16, 8, 256, 4096, 50.0),
                     (4, 4096, 1024, 4, 1, 256, 512, None)]
        kw = {}
    dtype = torch.float32 if DRY else torch.bfloat16
    rows = []
    for B, ctx, Hq, Hkv, D, W, cap in dec_cases:
        q, kc, vc, bt, _, lens = paged_inputs(B, ctx, 1, Hq, Hkv, D, dtype)
        opts = dict(sliding_window=W, softcap=cap)
        scale = D ** -0.5
        kv_bytes = 2 * B * min(ctx, W) * Hkv * D * kc.element_size()
        dkw = dict(block_n=16) if DRY else {}
        err = rel_err(kernels.paged_decode_attention(q, kc, vc, bt, lens, scale, **dkw, **opts),
                      kernels.paged_decode_attention_ref(q, kc, vc, bt, lens, scale, **opts))
        ms = bench_ms(lambda: kernels.paged_decode_attention(q, kc, vc, bt, lens, scale, **dkw, **opts))
        full_ms = bench_ms(lambda: kernels.paged_decode_attention(q, kc, vc, bt, lens, scale, **dkw))
        ref_ms = bench_ms(lambda: kernels.paged_decode_attention_ref(q, kc, vc, bt, lens, scale, **opts))
        rows.append(dict(kernel="decode:window", B=B, ctx=ctx, Hq=Hq, Hkv=Hkv, D=D, window=W, softcap=cap,
                         dtype=str(dtype), ms=ms, full_ms=full_ms, ref_ms=ref_ms, kv_bytes=kv_bytes,
                         GBps=kv_bytes / ms / 1e6, frac_copy_bw=kv_bytes / ms / 1e6 / copy_gbps, rel_err=err))
        del q, kc, vc
    for B, ctx, ql, Hq, Hkv, D, W, cap in pre_cases:
        q, kc, vc, bt, qsl, lens = paged_inputs(B, ctx, ql, Hq, Hkv, D, dtype)
        opts = dict(sliding_window=W, softcap=cap)
        args = (q, kc, vc, bt, qsl, lens, D ** -0.5, ql)
        prefix = ctx - ql
        attended = B * sum(min(prefix + i + 1, W) for i in range(ql))  # keys per query row in its window
        flops = 4 * attended * Hq * D
        err = rel_err(kernels.paged_prefill_attention(*args, **kw, **opts), kernels.paged_prefill_attention_ref(*args, **opts))
        ms = bench_ms(lambda: kernels.paged_prefill_attention(*args, **kw, **opts))
        full_ms = bench_ms(lambda: kernels.paged_prefill_attention(*args, **kw))
        ref_ms = bench_ms(lambda: kernels.paged_prefill_attention_ref(*args, **opts))
        rows.append(dict(kernel="prefill:window", B=B, ctx=ctx, q_len=ql, Hq=Hq, Hkv=Hkv, D=D, window=W, softcap=cap,
                         dtype=str(dtype), ms=ms, full_ms=full_ms, ref_ms=ref_ms, TFLOPs=flops / ms / 1e9, rel_err=err))
        del q, kc, vc
    return rows


def bench_store_kv(copy_gbps: float) -> list[dict]:
    T, Hkv, D = (20, 2, 64) if DRY else (8192, 8, 128)
    dtype = torch.float32 if DRY else torch.bfloat16
    bs = 16
    num_blocks = 4 * T // bs + 8
    kc = torch.randn(num_blocks, bs, Hkv, D, device=DEV, dtype=dtype)
    vc = torch.randn_like(kc)
    slots = torch.randperm(num_blocks * bs, device=DEV)[:T]
    key = torch.randn(T, Hkv, D, device=DEV, dtype=dtype)
    val = torch.randn_like(key)
    kernels.store_kv(key, val, kc, vc, slots)
    ok = bool(torch.equal(kc.view(-1, Hkv, D)[slots], key))
    nbytes = 2 * 2 * key.numel() * key.element_size()  # read K and V, write K and V
    ms = bench_ms(lambda: kernels.store_kv(key, val, kc, vc, slots))
    ref_ms = bench_ms(lambda: kernels.store_kv_ref(key, val, kc, vc, slots))
    return [dict(kernel="store_kv", T=T, Hkv=Hkv, D=D, dtype=str(dtype), ms=ms, ref_ms=ref_ms, exact=ok,
                 GBps=nbytes / ms / 1e6, frac_copy_bw=nbytes / ms / 1e6 / copy_gbps)]


def bench_rms_norm(copy_gbps: float) -> list[dict]:
    rows_n, hidden = (8, 576) if DRY else (16384, 4096)
    dtype = torch.float32 if DRY else torch.bfloat16
    x = torch.randn(rows_n, hidden, device=DEV, dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(hidden, device=DEV, dtype=dtype)
    err = rel_err(kernels.rms_norm(x, w, 1e-5, r)[0], kernels.rms_norm_ref(x, w, 1e-5, r)[0])
    nbytes = 4 * x.numel() * x.element_size()  # read x, residual; write out, new residual
    ms = bench_ms(lambda: kernels.rms_norm(x, w, 1e-5, r))
    ref_ms = bench_ms(lambda: kernels.rms_norm_ref(x, w, 1e-5, r))
    return [dict(kernel="rms_norm", rows=rows_n, hidden=hidden, dtype=str(dtype), ms=ms, ref_ms=ref_ms,
                 rel_err=err, GBps=nbytes / ms / 1e6, frac_copy_bw=nbytes / ms / 1e6 / copy_gbps)]


def bench_moe(copy_gbps: float) -> list[dict]:
    """Fused mixture-of-experts (kernels.moe_experts) against its eager per-expert reference:
    GB/s of the expert weights the step touches (decode is bound by them), TFLOP/s of the
    active experts' GEMMs."""
    if DRY:
        cases, dtype = [(5, 4, 2, 64, 32)], torch.float32
    else:  # (T, E, K, H, I): Qwen3-30B-A3B's MoE layer at decode 1 / 64 and a 4k-token prefill
        cases, dtype = [(1, 128, 8, 2048, 768), (64, 128, 8, 2048, 768), (4096, 128, 8, 2048, 768)], torch.bfloat16
    rows = []
    for T, E, K, H, I in cases:
        gen = torch.Generator().manual_seed(T)
        gate_up = (torch.randn(E, 2 * I, H, generator=gen) / H**0.5).to(DEV, dtype)
        down = (torch.randn(E, H, I, generator=gen) / I**0.5).to(DEV, dtype)
        x = torch.randn(T, H, generator=gen).to(DEV, dtype)
        w, ids = torch.topk(torch.softmax(torch.randn(T, E, generator=gen), -1), K, dim=-1)
        w, ids = (w / w.sum(-1, keepdim=True)).to(DEV), ids.to(DEV)
        err = rel_err(kernels.moe_experts(x, gate_up, down, w, ids), kernels.moe_experts_ref(x, gate_up, down, w, ids))
        ms = bench_ms(lambda: kernels.moe_experts(x, gate_up, down, w, ids))
        ref_ms = bench_ms(lambda: kernels.moe_experts_ref(x, gate_up, down, w, ids))
        touched = len(set(ids.flatten().tolist()))
        nbytes = touched * 3 * H * I * gate_up.element_size()
        flops = 2 * 3 * H * I * T * K
        rows.append(dict(kernel="moe", T=T, E=E, K=K, H=H, I=I, dtype=str(dtype), experts_hit=touched, ms=ms, ref_ms=ref_ms,
                         rel_err=err, GBps=nbytes / ms / 1e6, frac_copy_bw=nbytes / ms / 1e6 / copy_gbps,
                         TFLOPs=flops / ms / 1e9))
    return rows


def _lora_segments(lens: list[int], slots: list[int]):
    starts = [sum(lens[:i]) for i in range(len(lens))]
    return tuple(torch.tensor(v, dtype=torch.int32, device=DEV) for v in (starts, lens, slots))


def bench_lora(copy_gbps: float) -> list[dict]:
    """Multi-LoRA shrink (all slices of a fused projection in one launch) and expand (one launch
    per slice, as the model runs them) against the per-segment torch references: GB/s of what
    they must move (x or h, the A or B rows of the adapters in use, y read and written)."""
    from kernels.lora_sgmv import default_block_m

    if DRY:
        dtype, S, R, in_dim, outs = torch.float32, 3, 16, 40, (24, 8, 8)
        cases = [("decode-sorted", [2, 3], [0, 2]), ("prefill", [9, 4, 7], [1, -1, 0])]
    else:  # Llama-3-8B's qkv: 4096 -> 4096 + 1024 + 1024; 4 adapters in 8 slots
        dtype, S, R, in_dim, outs = torch.bfloat16, 8, 16, 4096, (4096, 1024, 1024)
        cases = [("decode-sorted", [16] * 4, [0, 1, 2, 3]),  # 64 sequences grouped by adapter
                 ("decode-1row", [1] * 64, [i % 4 for i in range(64)]),  # worst case: no grouping
                 ("prefill", [1024] * 4, [0, 1, 2, 3])]
    n = len(outs)
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(S, n * R, in_dim, generator=gen) / in_dim**0.5).to(DEV, dtype)
    bs = [(torch.randn(S, out, R, generator=gen) / R**0.5).to(DEV, dtype) for out in outs]
    rows = []
    for name, lens, slots in cases:
        T = sum(lens)
        seg = _lora_segments(lens, slots)
        tiles = kernels.lora_tiles(*seg, T, default_block_m(T, len(lens)))
        x = torch.randn(T, in_dim, generator=gen).to(DEV, dtype)
        y0 = torch.randn(T, sum(outs), generator=gen).to(DEV, dtype)
        used = len({s for s in slots if s >= 0})
        rows_on = sum(length for length, s in zip(lens, slots) if s >= 0)
        el = x.element_size()
        common = dict(case=name, T=T, segments=len(lens), adapters=used, n=n, R=R, in_dim=in_dim, outs=list(outs),
                      dtype=str(dtype))

        h = kernels.lora_shrink(x, a, *seg, tiles=tiles)
        err = rel_err(h, kernels.lora_shrink_ref(x, a, *seg))
        ms = bench_ms(lambda: kernels.lora_shrink(x, a, *seg, tiles=tiles))
        split_ms = None if DRY else bench_ms(lambda: kernels.lora_shrink(x, a, *seg, tiles=tiles, split_k=4))
        ref_ms = bench_ms(lambda: kernels.lora_shrink_ref(x, a, *seg))
        nbytes = rows_on * in_dim * el + used * n * R * in_dim * el + T * n * R * 4
        rows.append(dict(kernel="lora:shrink", **common, ms=ms, split4_ms=split_ms, ref_ms=ref_ms, rel_err=err,
                         GBps=nbytes / ms / 1e6, frac_copy_bw=nbytes / ms / 1e6 / copy_gbps))

        def expand(fn, y):
            off = 0
            for i, (b, out) in enumerate(zip(bs, outs)):
                fn(h[:, i * R:(i + 1) * R], b, *seg, y, off, **({"tiles": tiles} if fn is kernels.lora_expand else {}))
                off += out

        y, y_ref = y0.clone(), y0.clone()
        expand(kernels.lora_expand, y)
        expand(kernels.lora_expand_ref, y_ref)
        err = rel_err(y.double() - y0.double(), y_ref.double() - y0.double())  # the update itself, not y's own values, decides the error
        ms = bench_ms(lambda: expand(kernels.lora_expand, y))
        ref_ms = bench_ms(lambda: expand(kernels.lora_expand_ref, y))
        nbytes = T * n * R * 4 + used * sum(outs) * R * el + 2 * rows_on * sum(outs) * el
        rows.append(dict(kernel="lora:expand", **common, ms=ms, ref_ms=ref_ms, rel_err=err,
                         GBps=nbytes / ms / 1e6, frac_copy_bw=nbytes / ms / 1e6 / copy_gbps))
    return rows


# ---------------------------------------------------------------- report
def table(result: dict) -> str:
    lines = [f"copy bandwidth: {result['copy']['GBps']:.0f} GB/s (read+write)  device: {result['device']}"]
    lines.append(f"{'kernel':<14} {'shape':<52} {'ms':>8} {'ref ms':>8} {'x ref':>6} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8}")
    for r in result["rows"]:
        if r["kernel"] == "decode":
            continue  # the sweep: in the JSON; the table shows the default and the best
        if r["kernel"] in ("decode:best", "decode:default", "decode:window"):
            shape = f"B{r['B']} ctx{r['ctx']} H{r['Hq']}/{r['Hkv']} D{r['D']}"
        elif r["kernel"] in ("prefill", "prefill:window"):
            shape = f"B{r['B']} ctx{r['ctx']} q{r['q_len']} H{r['Hq']}/{r['Hkv']} D{r['D']}"
        elif r["kernel"].startswith("lora:"):
            shape = f"{r['case']} T{r['T']} seg{r['segments']} ad{r['adapters']} {r['n']}xR{r['R']} in{r['in_dim']}"
            if r.get("split4_ms"):
                shape += f" (split4 {r['split4_ms']:.3f}ms)"
        elif r["kernel"] == "moe":
            shape = f"T{r['T']} E{r['E']} top{r['K']} H{r['H']} I{r['I']} ({r['experts_hit']} hit)"
        elif r["kernel"] == "store_kv":
            shape = f"T{r['T']} Hkv{r['Hkv']} D{r['D']}"
        else:
            shape = f"{r['rows']}x{r['hidden']}"
        if "window" in r:  # the window's figures, then the same shape without it
            shape += f" W{r['window']}" + (f" cap{r['softcap']:g}" if r.get("softcap") else "")
            shape += f" (full {r['full_ms']:.3f}ms)"
        gb = f"{r['GBps']:.0f}" if "GBps" in r else "-"
        frac = f"{100 * r['frac_copy_bw']:.0f}%" if "frac_copy_bw" in r else "-"
        tf = f"{r['TFLOPs']:.1f}" if "TFLOPs" in r else "-"
        lines.append(f"{r['kernel']:<14} {shape:<52} {r['ms']:>8.3f} {r['ref_ms']:>8.3f} "
                     f"{r['ref_ms'] / r['ms']:>6.1f} {gb:>7} {frac:>6} {tf:>8}")
    return "\n".join(lines)


def main() -> None:
    if ARGS.summary is not None:
        print(table(json.loads(ARGS.summary.read_text())))
        return
    import triton

    name = torch.cuda.get_device_name() if not DRY else "cpu (dry run, TRITON_INTERPRET=1: timings meaningless)"
    result = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dry_run": DRY}
    result["copy"] = copy_bandwidth()
    bw = result["copy"]["GBps"]
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    only = {p for p in ARGS.only.split(",") if p} or set(PARTS)
    wanted = only - {p for p in ARGS.skip.split(",") if p}
    unknown = wanted - set(PARTS)
    if unknown:
        sys.exit(f"unknown parts {sorted(unknown)}; known: {', '.join(PARTS)}")
    if "decode" in wanted:
        dec = bench_decode(bw, sweep=not ARGS.no_sweep and not DRY)
        # First row of each shape is the default config with auto splits.
        seen = set()
        for r in dec:
            key = (r["B"], r["ctx"], r["Hq"], r["Hkv"], r["D"])
            if r["kernel"] == "decode" and key not in seen:
                seen.add(key)
                rows.append({**r, "kernel": "decode:default"})
            rows.append(r)
        print("decode done", flush=True)
    parts = {"prefill": bench_prefill, "window": lambda: bench_window(bw), "store_kv": lambda: bench_store_kv(bw),
             "rms_norm": lambda: bench_rms_norm(bw), "moe": lambda: bench_moe(bw), "lora": lambda: bench_lora(bw)}
    for name, part in parts.items():
        if name in wanted:
            rows += part()
    result["rows"] = rows
    bad = [r for r in rows if r.get("rel_err", 0.0) > 2e-2 or r.get("exact") is False]
    result["accuracy_ok"] = not bad
    out = ARGS.json or (ROOT / "bench" / "results" / "kernel_bench.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(table(result))
    print(f"full figures: {out}")
    if bad:
        print(f"ACCURACY FAILURES: {bad}")
        sys.exit(1)


if __name__ == "__main__":
    main()
