"""A MoE model through the whole CPU engine: the one-call expert kernel (kernels.moe_cpu) against
the grouped path it replaced (``QWORKER_CPU_MOE_KERNEL=0``), alternating in one process, same
requests, greedy outputs compared.

    python bench/moe_engine.py            # a random Qwen3-MoE: hidden 512, 6 layers, 32 experts top-8
    python bench/moe_engine.py --quick    # 2 rounds instead of 3

The model is random (the test tokenizer, a Qwen3-MoE config of the given shape), which does not
change a step's speed. Tokens/s = generated tokens / wall time of one ``LLM.generate`` of all the
requests; the median over rounds per path.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import report  # noqa: E402


def random_moe(tokenizer_dir: str, hidden: int, layers: int, experts: int, top_k: int, expert_inter: int) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(tempfile.mkdtemp(prefix="qworker-moe-"))
    config = AutoConfig.for_model("qwen3_moe", vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8, num_experts=experts,
                                  num_experts_per_tok=top_k, moe_intermediate_size=expert_inter, norm_topk_prob=True,
                                  max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, out / name)
    return str(out)


def main(argv=None) -> dict:
    ap = report.parser(__doc__, quick_help="2 rounds instead of 3")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-inter", type=int, default=256)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    from qworker import LLM, SamplingParams

    model = random_moe(args.model, args.hidden, args.layers, args.experts, args.top_k, args.expert_inter)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randrange(16, 128))] for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    paths = {"one call": "1", "grouped": "0"}
    rates: dict[str, list[float]] = {p: [] for p in paths}
    outputs: dict[str, list] = {}
    before = os.environ.get("QWORKER_CPU_MOE_KERNEL")
    try:
        for _ in range(2 if args.quick else 3):
            for path, flag in paths.items():
                os.environ["QWORKER_CPU_MOE_KERNEL"] = flag  # read as the layers are built
                llm = LLM(model, kv_cache_memory=256 << 20)
                llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                rates[path].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
                outputs[path] = [o.outputs[0].token_ids for o in outs]
                del llm
    finally:
        if before is None:
            os.environ.pop("QWORKER_CPU_MOE_KERNEL", None)
        else:
            os.environ["QWORKER_CPU_MOE_KERNEL"] = before
        shutil.rmtree(model, ignore_errors=True)
    result = report.meta("cpu", "float32")
    result.update(shape=dict(hidden=args.hidden, layers=args.layers, experts=args.experts, top_k=args.top_k, expert_inter=args.expert_inter),
                  requests=args.requests, max_tokens=args.max_tokens, tokens_per_s=rates,
                  median={p: statistics.median(v) for p, v in rates.items()}, identical_outputs=outputs["one call"] == outputs["grouped"])
    result["ratio"] = result["median"]["one call"] / result["median"]["grouped"]
    report.publish(result, "moe-engine", args.out, lambda path, r: None, markdown)
    return result


def markdown(r: dict) -> str:
    s = r["shape"]
    rows = [[p, " / ".join(f"{v:.0f}" for v in r["tokens_per_s"][p]), f"{r['median'][p]:.0f}"] for p in r["tokens_per_s"]]
    return "\n".join([
        report.header(r), "",
        f"random Qwen3-MoE: hidden {s['hidden']}, {s['layers']} layers, {s['experts']} experts top-{s['top_k']} of {s['expert_inter']}; "
        f"{r['requests']} requests x {r['max_tokens']} tokens, greedy", "",
        report.table(["path", "tok/s (rounds)", "median tok/s"], rows), "",
        f"one call / grouped: {r['ratio']:.2f}x; identical outputs: {r['identical_outputs']}"])


if __name__ == "__main__":
    main()
