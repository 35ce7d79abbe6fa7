"""CPU paged attention against the memory floor: decode attention time vs the time to read the
KV bytes once at this machine's measured memory bandwidth, and whole-model prefill tokens/s with
the C extend kernel vs the torch reference.

    python bench/attention_cpu.py                              # decode, batches 16/48/128
    python bench/attention_cpu.py --baseline-rev 4cc0e5c       # + the decode kernel of that commit
    python bench/attention_cpu.py --prefill 256,1024,4096      # + whole-model prefill tokens/s
    python bench/attention_cpu.py --bf16-products              # a bf16 cache as the bf16 mode reads it

Decode: SmolLM2's shapes by default (9 query heads, 3 KV heads, head dim 64, 30 layers, pages of
16 tokens), context lengths drawn uniformly from [--min-len, --max-len] (the mixed workload's
100-500), every layer with its own cache, on huge pages as the engine's pool, whose pages are
shuffled (as after the block manager has churned; ``--page-order in-order`` lays each sequence's
pages one after another). One timed pass = the decode attention of all layers for one step; before each pass a
buffer larger than the last-level cache is written, so the KV arrives from memory as it does in a
real step (the weights stream through the caches between two attention calls). The paths are
timed alternately, round after round, and the medians compared: the machine may be shared.
floor = KV bytes of the step (K and V of every attended token, every layer, read once) / bandwidth;
bandwidth = 2 x bytes / time of a large ``torch`` copy (read + write), measured in the same run.
Paths: ``c:<isa>`` for each vector ISA this CPU runs (:func:`kernels.cpu.available_isas`),
``c@<rev>`` the decode kernel as it was at a git revision (built as that revision built it), and
``reference`` (torch gather + SDPA, with ``--reference``).

Prefill: the model (``--model``) through the LLM API, one prompt at a time, ``max_tokens=1``
(prompt tokens/s = prompt length / time of the request), the C extend kernel and the torch
reference (:func:`kernels.paged_prefill_attention_ref`) alternating request by request.
"""

from __future__ import annotations

import ctypes
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kernels  # noqa: E402
from bench import report  # noqa: E402
from kernels import cpu as kcpu  # noqa: E402
from qworker.model.kv_cache import huge_page_zeros  # noqa: E402

MiB = 1 << 20
CLOCK = time.perf_counter


def main(argv=None) -> dict:
    ap = report.parser(__doc__, quick_help="3 rounds instead of 9")
    ap.add_argument("--batches", default="16,48,128")
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=500)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--page-order", choices=["shuffled", "in-order"], default="shuffled",
                    help="where a sequence's pages sit in the pool: scattered (after churn) or one after another")
    ap.add_argument("--cache-dtypes", default="float32,bfloat16")
    ap.add_argument("--bf16-products", action="store_true",
                    help="a bf16 cache's products in bf16, the CPU bf16 mode's decode kernel (qw_paged_decode_bf16_dp)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--flush-mib", type=int, default=96, help="buffer written before each pass (0: none)")
    ap.add_argument("--bandwidth-mib", type=int, default=256, help="size of the copy that measures the bandwidth")
    ap.add_argument("--isas", default="", help="comma-separated ISA builds to time (default: every available one)")
    ap.add_argument("--baseline-rev", default="", help="also time the decode kernel of this git revision")
    ap.add_argument("--reference", action="store_true", help="also time the torch reference")
    ap.add_argument("--prefill", default="", help="prompt lengths for the whole-model prefill rows (empty: none)")
    ap.add_argument("--prefill-rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU time instead of wall time (with --threads 1, robust to a shared machine)")
    args = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (3 if args.quick else 9)
    result = report.meta("cpu", args.cache_dtypes)
    result.update(clock=args.clock, cpu_flags=_isa_flags(), isa_chosen=kcpu.cpu_isa(), available_isas=kcpu.available_isas(),
                  bandwidth_gb_s=measure_bandwidth(args.bandwidth_mib), rounds=rounds,
                  shape=dict(layers=args.layers, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                             block_size=args.block_size, min_len=args.min_len, max_len=args.max_len),
                  decode=[], prefill=[])
    print(f"bandwidth {result['bandwidth_gb_s']:.1f} GB/s (copy), ISA {result['isa_chosen']}", file=sys.stderr, flush=True)
    isas = [i for i in args.isas.split(",") if i] or kcpu.available_isas()
    paths = {f"c:{isa}": _isa_path(isa) for isa in isas}
    if args.baseline_rev:
        paths[f"c@{args.baseline_rev}"] = _revision_path(args.baseline_rev)
    if args.reference:
        paths["reference"] = kernels.paged_decode_attention_ref
    flush = torch.empty(args.flush_mib * MiB // 4) if args.flush_mib else None
    for dtype_name in [d for d in args.cache_dtypes.split(",") if d]:
        for batch in (int(b) for b in args.batches.split(",") if b):
            row = decode_case(args, getattr(torch, dtype_name), batch, paths, rounds, flush, result["bandwidth_gb_s"])
            result["decode"].append(row)
            print(f"decode {dtype_name} batch {batch}: " + "  ".join(f"{p} {v:.2f} ms ({row['vs_floor'][p]:.2f}x)"
                                                                     for p, v in row["ms"].items()), file=sys.stderr, flush=True)
    prompt_lens = [int(x) for x in args.prefill.split(",") if x]
    if prompt_lens:
        from qworker.engine import LLM

        llm = LLM(args.model, max_model_len=max(prompt_lens) + 16, enable_prefix_caching=False, swap_space=0)
        for n in prompt_lens:
            result["prefill"].append(prefill_case(llm, args, n))
    report.publish(result, "attention_cpu", args.out, plot, markdown)
    return result


def measure_bandwidth(mib: int = 256, reps: int = 7) -> float:
    """GB/s of a large fp32 ``copy_`` on all torch threads, counting the bytes read and written."""
    src = torch.ones(mib * MiB // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    times = []
    for _ in range(reps):
        start = CLOCK()
        dst.copy_(src)
        times.append(CLOCK() - start)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def decode_case(args, cache_dtype: torch.dtype, batch: int, paths: dict, rounds: int, flush, bandwidth: float) -> dict:
    rng = random.Random(args.seed + batch)
    lens = [rng.randint(args.min_len, args.max_len) for _ in range(batch)]
    bs, hkv, d = args.block_size, args.kv_heads, args.head_dim
    need = [-(-n // bs) for n in lens]
    nblocks = sum(need) + 4
    gen = torch.Generator().manual_seed(args.seed)
    layers = []
    for _ in range(args.layers):
        ids = torch.randperm(nblocks, generator=gen) if args.page_order == "shuffled" else torch.arange(nblocks)
        table = torch.zeros(batch, max(need), dtype=torch.int32)
        at = 0
        for b, n in enumerate(need):
            table[b, :n] = ids[at:at + n].to(torch.int32)
            at += n
        # on huge pages where the kernel allows them, as the engine's pool is
        k, v = (huge_page_zeros((nblocks, bs, hkv, d), cache_dtype) for _ in range(2))
        k.copy_(torch.randn(nblocks, bs, hkv, d, generator=gen))
        v.copy_(torch.randn(nblocks, bs, hkv, d, generator=gen))
        layers.append((k, v, table))
    q = torch.randn(batch, args.heads, d, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = d ** -0.5
    out = torch.empty_like(q)
    kv_bytes = sum(lens) * hkv * d * 2 * torch.finfo(cache_dtype).bits // 8 * args.layers
    floor_ms = kv_bytes / (bandwidth * 1e9) * 1e3
    times: dict[str, list[float]] = {p: [] for p in paths}
    products = {"bf16_products": True} if args.bf16_products and cache_dtype == torch.bfloat16 else {}
    for fn in paths.values():  # warm-up: builds, first touch
        fn(q, *layers[0][:2], layers[0][2], seq_lens, scale, out=out, **products)
    for r in range(rounds):
        names = list(paths)
        names = names[r % len(names):] + names[:r % len(names)]  # rotate: no path always runs after the flush's echo
        for p in names:
            if flush is not None:
                flush.fill_(float(r))
            start = CLOCK()
            for k, v, table in layers:
                paths[p](q, k, v, table, seq_lens, scale, out=out, **products)
            times[p].append(CLOCK() - start)
    ms = {p: statistics.median(t) * 1e3 for p, t in times.items()}
    return dict(cache_dtype=str(cache_dtype).replace("torch.", ""), batch=batch, context_tokens=sum(lens),
                kv_mib=kv_bytes / MiB, floor_ms=floor_ms, ms=ms, vs_floor={p: m / floor_ms for p, m in ms.items()},
                ms_min={p: min(t) * 1e3 for p, t in times.items()})


def _isa_path(isa: str):
    def run(*a, **kw):
        with kcpu.using_isa(isa):
            return kernels.paged_decode_attention_cpu(*a, **kw)
    return run


def _revision_path(rev: str):
    """The decode kernel of git revision ``rev``, compiled with that revision's flags, behind the
    current wrapper's argument marshalling (the C signature is unchanged since it took a window)."""
    root = Path(__file__).resolve().parents[1]
    tmp = Path(tempfile.mkdtemp(prefix="qw-attn-rev-"))
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:kernels/csrc"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        (tmp / name).write_bytes(subprocess.run(["git", "show", f"{rev}:kernels/csrc/{name}"], cwd=root, check=True,
                                                capture_output=True).stdout)
    so = tmp / "rev.so"
    subprocess.run(["cc", "-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=gnu11",
                    "-o", str(so), *(str(tmp / n) for n in names if n.endswith(".c"))], check=True)
    lib = ctypes.CDLL(str(so))
    fns = {}
    for suffix in ("f32", "f16", "bf16", "bf16_dp"):
        fn = getattr(lib, f"qw_paged_decode_{suffix}", None)  # bf16_dp: from 7697073 on
        if fn is not None:
            fn.argtypes, fn.restype = kcpu._DECODE_ARGS, ctypes.c_int
            fns[suffix] = fn

    class _RevisionLibrary:  # the wrapper's bf16-products lookup, answered by that revision
        qw_paged_decode_bf16_dp = fns.get("bf16_dp")

    def run(*args, **kwargs):
        # the current wrapper (same checks and marshalling), with that revision's C function
        real, real_library = kcpu._cache_fn, kcpu._library
        kcpu._cache_fn = lambda name, dtype: fns.get(kcpu._SUFFIX.get(dtype)) if name == "qw_paged_decode" else real(name, dtype)
        kcpu._library = lambda: _RevisionLibrary
        try:
            return kernels.paged_decode_attention_cpu(*args, **kwargs)
        finally:
            kcpu._cache_fn, kcpu._library = real, real_library
    return run


def prefill_case(llm, args, prompt_len: int) -> dict:
    """Whole-model prompt tokens/s at one prompt length: extend kernel vs reference, alternating."""
    from qworker.engine import SamplingParams

    rng = random.Random(args.seed + prompt_len)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    times: dict[str, list[float]] = {"extend kernel": [], "reference": []}
    for r in range(args.prefill_rounds + 1):
        for name in (list(times) if r % 2 == 0 else list(times)[::-1]):
            kcpu.EXTEND_KERNEL = name == "extend kernel"
            prompt = [rng.randint(100, 20000) for _ in range(prompt_len)]
            start = CLOCK()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            if r:  # round 0 warms up
                times[name].append(CLOCK() - start)
    kcpu.EXTEND_KERNEL = True
    tps = {p: prompt_len / statistics.median(t) for p, t in times.items()}
    print(f"prefill {prompt_len}: " + "  ".join(f"{p} {v:.0f} tok/s" for p, v in tps.items()), file=sys.stderr, flush=True)
    return dict(prompt_tokens=prompt_len, tokens_per_s=tps, speedup=tps["extend kernel"] / tps["reference"])


def _isa_flags() -> list[str]:
    words = kcpu._cpu_features().split()
    return sorted(w for w in words if w.startswith(("avx", "amx", "fma", "f16c")))


def markdown(r: dict) -> str:
    s = r["shape"]
    lines = [report.header(r), "",
             f"bandwidth {r['bandwidth_gb_s']:.1f} GB/s (copy); ISA chosen: {r['isa_chosen']} (available: "
             f"{', '.join(r['available_isas'])}); CPU flags: {' '.join(r['cpu_flags'])}", "",
             f"Decode attention, {s['layers']} layers, {s['heads']} query / {s['kv_heads']} KV heads, head dim {s['head_dim']}, "
             f"contexts {s['min_len']}-{s['max_len']}: ms per step (median of {r['rounds']}) and time / (KV bytes / bandwidth)", ""]
    if r["decode"]:
        paths = list(r["decode"][0]["ms"])
        rows = [[c["cache_dtype"], c["batch"], round(c["kv_mib"], 1), c["floor_ms"],
                 *(f"{c['ms'][p]:.2f} ({c['vs_floor'][p]:.2f}x)" for p in paths)] for c in r["decode"]]
        lines.append(report.table(["KV dtype", "batch", "KV MiB", "floor ms", *paths], rows))
    if r["prefill"]:
        rows = [[c["prompt_tokens"], round(c["tokens_per_s"]["reference"]), round(c["tokens_per_s"]["extend kernel"]),
                 f"{c['speedup']:.2f}x"] for c in r["prefill"]]
        lines += ["", "Whole-model prefill, one prompt at a time, max_tokens=1 (prompt tokens/s, median)", "",
                  report.table(["prompt tokens", "reference", "extend kernel", "speedup"], rows)]
    return "\n".join(lines)


def plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if r["decode"]:
        paths = list(r["decode"][0]["ms"])
        labels = [f"{c['cache_dtype']} b{c['batch']}" for c in r["decode"]]
        n = len(paths)
        for i, p in enumerate(paths):
            xs = [j + (i - (n - 1) / 2) * 0.8 / n for j in range(len(labels))]
            ax.bar(xs, [c["vs_floor"][p] for c in r["decode"]], width=0.8 / n, label=p)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("time / memory floor")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
