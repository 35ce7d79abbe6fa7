"""Greedy token match of qworker in a reduced precision against HF transformers in bf16 and fp32.

    python bench/bf16_parity.py                       # qworker dtype=bfloat16 (needs AVX512_BF16/AMX)
    python bench/bf16_parity.py --kv-cache-dtype bfloat16 --dtype float32   # a bf16 KV cache only

Prompts: ``--num-prompts`` slices of the licence texts (16-256 tokens), ``--max-tokens`` greedy
tokens each, EOS ignored. For each reference: requests whose whole output is identical, and the
token match rate (tokens equal before a request's first divergence, over all tokens: once two
greedy sequences diverge they stay apart, so later positions say nothing).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import report, workloads  # noqa: E402


def hf_greedy(model_dir: str, dtype: torch.dtype, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.inference_mode():
        for p in prompts:
            o = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=max_tokens,
                               do_sample=False, pad_token_id=0)
            outs.append(o[0, len(p):].tolist())
    return outs


def match(ours: list[list[int]], ref: list[list[int]]) -> dict:
    prefix = 0
    for a, b in zip(ours, ref):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += n
    total = sum(len(b) for b in ref)
    return {"identical_requests": sum(a == b for a, b in zip(ours, ref)), "requests": len(ref), "token_match_rate": prefix / total}


def main(argv=None) -> dict:
    ap = report.parser(__doc__, quick_help="4 prompts, 16 tokens")
    ap.set_defaults(dtype="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 16 (--quick 4)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64 (--quick 16)")
    args = ap.parse_args(argv)
    n = args.num_prompts or (4 if args.quick else 16)
    m = args.max_tokens or (16 if args.quick else 64)
    from qworker import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    items = workloads.mixed(llm.tokenizer, num=n, seed=args.seed, output_range=(m, m))
    prompts = [it.prompt_ids for it in items]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    ours = [list(o.outputs[0].token_ids) for o in outs]
    result = report.meta(args.device, args.dtype)
    result.update(kv_cache_dtype=str(llm.engine.runner.kv_dtype), linear_backend=llm.engine.runner.model.linear_backend,
                  prompts=n, max_tokens=m, vs={})
    del llm
    for name, dt in (("hf_bfloat16", torch.bfloat16), ("hf_float32", torch.float32)):
        result["vs"][name] = match(ours, hf_greedy(args.model, dt, prompts, m))
    report.publish(result, "bf16_parity", args.out, plot, markdown)
    return result


def markdown(r: dict) -> str:
    rows = [[name, f"{v['identical_requests']}/{v['requests']}", f"{v['token_match_rate']:.1%}"] for name, v in r["vs"].items()]
    return "\n".join([report.header(r), "", f"qworker dtype {r['dtype']}, KV {r['kv_cache_dtype']}, linears {r['linear_backend']}; "
                      f"{r['prompts']} prompts x {r['max_tokens']} greedy tokens", "",
                      report.table(["reference", "identical requests", "token match rate"], rows)])


def plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(4, 3))
    report.bars(ax, list(r["vs"]), [v["token_match_rate"] * 100 for v in r["vs"].values()], "token match rate (%)", f"qworker {r['dtype']}", highlight=())
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
