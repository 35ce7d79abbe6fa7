"""Tensor parallelism on this host: decode and prefill step time at ``tensor_parallel_size`` 1
and 2 side by side (the same engine config, one run), rank 0's all-reduce share, the cost of
broadcasting a step's pickled batch, and the LM head's share of rank 0's step (it runs on rank 0
only: the figure a vocab-parallel head would halve, at the price of a gather).

    python bench/tensor_parallel.py [--model models/smollm2-135m] [--batch 8] [--steps 20]
    python bench/tensor_parallel.py --device cuda --dtype bfloat16 --random-weights   # bench/gpu_check.sh, >= 2 GPUs

Each run also compares the greedy tokens of both sizes and says whether they are identical (on
CPU in fp32 they are expected to be; in bf16 the all-reduce's rounding may flip a near-tie, so
there the comparison is reported, not required).

On CPU the ranks share the host's cores (each gets cpu_count / tp threads), so TP cannot be
faster here than one rank with every core: this measures the overheads, not the scaling a
multi-GPU node gets. Medians of ``--steps`` steps after two warm-up steps.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(model: str, tp: int, batch: int, steps: int, prompt_len: int, device: str = "auto", dtype: str = "auto") -> dict:
    import torch

    from qworker.engine import EngineConfig, LLMEngine, SamplingParams

    e = LLMEngine(EngineConfig(model=model, tensor_parallel_size=tp, kv_cache_memory=256 << 20, swap_space=0, enable_prefix_caching=False,
                               max_num_batched_tokens=max(1024, batch * prompt_len), device=device, dtype=dtype))
    try:
        real = e.runner.execute
        times: list[tuple[int, float]] = []
        batches: list = []

        def timed(b):
            t0 = time.perf_counter()
            out = real(b)
            times.append((sum(len(c.token_ids) for c in b.chunks), time.perf_counter() - t0))
            batches.append(b)
            return out

        e.runner.execute = timed
        params = SamplingParams(temperature=0, max_tokens=steps + 3, ignore_eos=True)
        for i in range(batch):
            e.add_request(str(i), list(range(1000 + i, 1000 + i + prompt_len)), params)
        tokens = {}
        while e.has_unfinished():
            for r in e.step():
                if r.finished:
                    tokens[r.request_id] = r.seqs[0].output_token_ids
        prefill = [t for n, t in times if n > batch]
        decode = [t for n, t in times if n == batch][2:]
        m = e.runner.model
        head_x = torch.randn(batch, m.config.hidden_size, device=m.device, dtype=m.act_dtype)
        head = []
        for _ in range(10):
            t0 = time.perf_counter()
            e.runner.model.lm_head(head_x)
            if m.device.type == "cuda":
                torch.cuda.synchronize()
            head.append(time.perf_counter() - t0)
        pickled = len(pickle.dumps(("step", batches[-1])))
        t0 = time.perf_counter()
        for _ in range(100):
            pickle.loads(pickle.dumps(("step", batches[-1])))
        pickle_s = (time.perf_counter() - t0) / 100
        stats = e.stats()
        out = {"tp": tp, "prefill_ms": 1e3 * statistics.median(prefill), "decode_ms": 1e3 * statistics.median(decode),
               "lm_head_ms": 1e3 * statistics.median(head), "batch_bytes": pickled, "pickle_ms": 1e3 * pickle_s, "tokens": tokens}
        if tp > 1:
            ranks = e.runner.rank_stats()
            out["allreduce_ms_per_step"] = [1e3 * r["allreduce_seconds"] / r["steps"] for r in ranks]
            out["step_ms_per_rank"] = [1e3 * r["step_seconds"] / r["steps"] for r in ranks]
        return out
    finally:
        if hasattr(e.runner, "close"):
            e.runner.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--random-weights", action="store_true", help="a random-weight copy of --model (no safetensors needed)")
    args = ap.parse_args()
    model = args.model
    if args.random_weights:
        from bench.random_model import random_weight_copy

        model = random_weight_copy(model)
    rows = [measure(model, tp, args.batch, args.steps, args.prompt_len, args.device, args.dtype) for tp in (1, 2)]
    for r in rows:
        extra = ""
        if r["tp"] > 1:
            extra = (f"  per rank: step {', '.join(f'{v:.1f}' for v in r['step_ms_per_rank'])} ms, "
                     f"all-reduce {', '.join(f'{v:.1f}' for v in r['allreduce_ms_per_step'])} ms/step")
        print(f"tp={r['tp']}: prefill {args.batch}x{args.prompt_len} {r['prefill_ms']:.1f} ms, decode batch {args.batch} "
              f"{r['decode_ms']:.1f} ms/step, LM head {r['lm_head_ms']:.2f} ms, batch pickle {r['batch_bytes']} B "
              f"{r['pickle_ms']:.3f} ms{extra}")
    same = rows[0]["tokens"] == rows[1]["tokens"]
    print(f"greedy tokens tp=1 vs tp=2: {'identical' if same else 'DIFFERENT'} ({len(rows[0]['tokens'])} requests)")


if __name__ == "__main__":
    main()
