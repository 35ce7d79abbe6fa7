"""Speculative decoding with n-gram (prompt-lookup) drafts on a copying workload: tokens/s with
speculation off, on (fixed ``k``) and ``auto``, at 1, 4, 16 and 64 concurrent requests, in one run.

    python bench/spec_decode.py [--quick]

Workload: chat prompts built from corpus passages (100-180 words of licence text) whose answer
copies them: two in three ask to rewrite the passage exactly as given, one in three to quote the
passage's sentences that mention one of its words (SmolLM2-135M copies the first kind almost
verbatim, the second partly). Greedy, ``max_tokens`` capped, EOS ends a job (outputs are
identical in every mode, so each mode generates the same tokens; checked).

Each concurrency level runs closed-loop: ``c`` jobs in flight, a finished one replaced by the
next, until ``jobs`` jobs are done (``2c`` up to 4 concurrent, at least 3; one wave of ``c`` above:
the 64-job level alone takes minutes per mode on 2 cores); tokens/s = output tokens / wall time of the level (prefill
included). The three engines (off, ``k`` fixed, ``auto`` with the same ``k``) live in one process
and take turns per level, in an order that rotates per round; each is warmed up first. ``auto``
keeps what it learned from one level to the next, as a pod would. Figures are medians over
``--rounds``.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import drive, report, workloads  # noqa: E402
from qworker.engine import SamplingParams  # noqa: E402

REWRITE = "Rewrite the following text exactly as it is given:\n\n{text}"
EXTRACT = "Here is a document:\n\n{text}\n\nQuote the sentences of the document that mention \"{word}\"."
MODES = ("off", "ngram", "auto")


def make_jobs(tok, num: int, seed: int, max_tokens: int, words_range=(100, 180)) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    words = workloads.corpus_text().split()
    jobs = []
    for i in range(num):
        n = rng.randint(*words_range)
        start = rng.randrange(len(words) - n)
        text = " ".join(words[start : start + n])
        if i % 3 == 2:
            word = max(text.split()[: n // 2], key=len).strip(".,;:()\"'")
            content = EXTRACT.format(text=text, word=word)
        else:
            content = REWRITE.format(text=text)
        ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False)
        jobs.append((list(ids), SamplingParams(temperature=0, max_tokens=max_tokens)))
    return jobs


def closed_loop(engine, jobs, concurrency: int, tag: str) -> dict:
    """Keeps ``concurrency`` jobs in flight until all are done; output tokens/s over the span."""
    before = engine.stats()
    pending = list(enumerate(jobs))
    outputs: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    in_flight = 0
    while pending or engine.has_unfinished():
        while pending and in_flight < concurrency:
            k, (ids, params) = pending.pop(0)
            engine.add_request(f"{tag}-{k}", ids, params)
            in_flight += 1
        for req in engine.step():
            if req.finished:
                in_flight -= 1
                outputs[int(req.request_id.rsplit("-", 1)[1])] = req.seqs[0].output_token_ids
    seconds = time.perf_counter() - t0
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in ("generation_tokens", "steps", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                               "spec_decode_num_accepted_tokens", "spec_decode_num_spec_steps")}
    tokens = sum(len(v) for v in outputs.values())
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds, "outputs": [outputs[k] for k in sorted(outputs)], **delta}


def main(argv: list[str] | None = None) -> dict:
    ap = report.parser(__doc__, quick_help="levels 1,4,16,64 with one wave of jobs (c, at least 3), outputs up to 64 tokens")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--jobs-per-level", type=int, default=0, help="jobs per level (0: max(3, 2 x concurrency))")
    ap.add_argument("--max-output", type=int, default=192)
    ap.add_argument("--k", type=int, default=6, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--kv-memory-mib", type=float, default=512)
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(max_output=64)
        args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    configs = {"off": None, "ngram": spec, "auto": {**spec, "policy": "auto"}}
    engines = {m: drive.new_engine(args.model, args.device, args.dtype, args.kv_memory_mib, max_num_seqs=256, speculative_config=c)
               for m, c in configs.items()}
    tok = engines["off"].tokenizer
    result = report.meta(str(engines["off"].runner.device), str(engines["off"].runner.dtype))
    result["config"] = {"speculative_config": spec, "max_output": args.max_output, "levels": levels, "rounds": args.rounds}
    warm = make_jobs(tok, 4, args.seed + 999, 16)
    for m, e in engines.items():
        drive.warm_up(e)
        report.run_threaded(closed_loop, e, warm, 4, f"warm-{m}")

    result["levels"] = []
    for c in levels:
        n = args.jobs_per_level or max(3, c if args.quick or c > 4 else 2 * c)
        jobs = make_jobs(tok, n, args.seed + c, args.max_output)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            order = MODES[r % 3 :] + MODES[: r % 3]
            for m in order:
                print(f"concurrency {c}: round {r + 1}/{args.rounds}, {m} ({n} jobs) ...", flush=True)
                runs[m].append(report.run_threaded(closed_loop, engines[m], jobs, c, f"c{c}-{m}-{r}"))
        level = {"concurrency": c, "jobs": n, "prompt_tokens": sum(len(i) for i, _ in jobs),
                 "identical_outputs": all(x["outputs"] == runs["off"][0]["outputs"] for m in MODES for x in runs[m])}
        for m in MODES:
            xs = runs[m]
            drafted = sum(x["spec_decode_num_draft_tokens"] for x in xs)
            accepted = sum(x["spec_decode_num_accepted_tokens"] for x in xs)
            drafts = sum(x["spec_decode_num_drafts"] for x in xs)
            level[m] = {
                "tokens_per_s": statistics.median(x["tokens_per_s"] for x in xs),
                "output_tokens": xs[0]["output_tokens"],
                "steps": statistics.median(x["steps"] for x in xs),
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
                "spec_step_share": sum(x["spec_decode_num_spec_steps"] for x in xs) / max(sum(x["steps"] for x in xs), 1),
                "tokens_per_s_rounds": [x["tokens_per_s"] for x in xs],
            }
        for m in ("ngram", "auto"):
            level[f"{m}_ratio"] = level[m]["tokens_per_s"] / level["off"]["tokens_per_s"]
        result["levels"].append(level)
        print(f"  off {level['off']['tokens_per_s']:.1f} tok/s, ngram x{level['ngram_ratio']:.2f}, auto x{level['auto_ratio']:.2f}, "
              f"acceptance {level['ngram']['acceptance_rate']:.2f}", flush=True)
    result["auto_policy"] = engines["auto"].spec_policy.stats() | {"cost_buckets": len(engines["auto"].spec_policy.cost._buckets)}
    report.publish(result, "spec_decode", args.out, plot, markdown)
    return result


def markdown(r: dict) -> str:
    k = r["config"]["speculative_config"]["num_speculative_tokens"]
    rows = [[lv["concurrency"], lv["off"]["tokens_per_s"], lv["ngram"]["tokens_per_s"], lv["auto"]["tokens_per_s"],
             f"{lv['ngram_ratio']:.2f}x", f"{lv['auto_ratio']:.2f}x", f"{lv['ngram']['acceptance_rate']:.2f}",
             f"{lv['ngram']['mean_acceptance_length']:.2f}", f"{lv['auto']['spec_step_share']:.2f}", "yes" if lv["identical_outputs"] else "NO"]
            for lv in r["levels"]]
    return "\n".join([
        report.header(r),
        "",
        report.table(["concurrent", "off tok/s", f"ngram k={k} tok/s", "auto tok/s", "ngram/off", "auto/off", "acceptance",
                      "mean accepted length", "auto: share of steps drafting", "same outputs"], rows),
    ])


def plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    cs = [lv["concurrency"] for lv in r["levels"]]
    for m, label in (("ngram", "ngram (k fixed) / off"), ("auto", "auto / off")):
        ax.plot(cs, [lv[f"{m}_ratio"] for lv in r["levels"]], marker="o", label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("tokens/s ratio to no speculation")
    ax.set_title("n-gram speculative decoding, copying workload", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
