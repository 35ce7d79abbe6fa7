"""Structured output cost: the mixed workload with half of the jobs carrying a JSON schema, against
the same workload unconstrained, in one run (one process, one engine).

    python bench/structured_throughput.py [--quick]

Workload: ``workloads.mixed`` prompts (corpus slices, 16-256 tokens); every other job gets an
extraction instruction appended and one of three JSON schemas (rotating: a record with enums,
integer and number ranges and a nested object; a list of items with a string pattern; a
classification; strings have a ``maxLength``, the costly case for the mask). Greedy. The
grammars are compiled before the timed runs (jobs repeat schemas: steady state is a cache hit;
compile time is reported apart), and one untimed constrained pass warms every batch shape up.

* ``constrained``: the half with schemas masked every step; they end when their grammar
  completes (or at ``max_tokens``), the other half ignores EOS as in the throughput bench.
* ``unconstrained``: the same prompts, each job made to produce exactly as many tokens as it did
  in the constrained run (EOS ignored), so both runs generate the same tokens in the same jobs.

Reports output tokens/s of each, their ratio, the share of constrained outputs that finished
"stop" and validate, and the engine's mask time. ``--rounds`` rounds of both runs, alternating
which goes first; the figures are the medians.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import drive, report, workloads  # noqa: E402
from qworker.engine import SamplingParams  # noqa: E402
from qworker.engine.structured import StructuredOutputsParams  # noqa: E402

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 48},
            "kind": {"enum": ["licence", "contract", "notice", "other"]},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "parties": {"type": "array", "items": {"type": "string", "maxLength": 32}, "minItems": 1, "maxItems": 4},
            "meta": {"type": "object", "properties": {"lang": {"enum": ["en", "de", "fr"]}, "pages": {"type": "integer", "minimum": 1}}, "required": ["lang"]},
        },
        "required": ["title", "kind", "year", "parties", "meta"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}, "text": {"type": "string", "maxLength": 48}}, "required": ["code", "text"]},
                "minItems": 2,
                "maxItems": 5,
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"label": {"enum": ["permission", "obligation", "prohibition"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}, "reason": {"type": "string", "maxLength": 64}},
        "required": ["label", "confidence", "reason"],
    },
]
INSTRUCTION = "\n\nExtract the key facts of the text above as JSON:\n"


def constrained_items(tok, items):
    """(prompt ids, params, schema or None) per job: even jobs carry a schema."""
    suffix = tok.encode(INSTRUCTION)
    jobs = []
    for i, it in enumerate(items):
        if i % 2 == 0:
            schema = SCHEMAS[(i // 2) % len(SCHEMAS)]
            spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
            jobs.append((it.prompt_ids + suffix, SamplingParams(max_tokens=it.max_tokens, temperature=0, structured_outputs=spec), schema))
        else:
            jobs.append((it.prompt_ids, drive.greedy(it.max_tokens), None))
    return jobs


def run_constrained(engine, jobs, tag="c"):
    before = engine.stats()
    con = drive.drive(engine, [drive.Job(workloads.Item(ids, p.max_tokens, 1, "json" if s else "text"), 0.0, p, f"{tag}{k}") for k, (ids, p, s) in enumerate(jobs)], timeline=False)
    after = engine.stats()
    return con, {k: after[k] - before[k] for k in ("mask_seconds", "mask_steps", "masked_rows", "steps", "grammar_compilations")}


def run_unconstrained(engine, jobs, lengths, tag="u"):
    """The same jobs, each producing exactly ``lengths[k]`` tokens (EOS ignored), no schema."""
    plain = drive.drive(engine, [drive.Job(workloads.Item(ids, n, 1, "json" if s else "text"), 0.0, drive.greedy(n), f"{tag}{k}")
                                 for k, ((ids, _, s), n) in enumerate(zip(jobs, lengths))], timeline=False)
    assert sum(r["output_tokens"] for r in plain.requests) == sum(lengths)
    return plain


def run_round(engine, jobs, lengths, constrained_first: bool):
    if constrained_first:
        con, mask = run_constrained(engine, jobs)
        plain = run_unconstrained(engine, jobs, lengths)
    else:
        plain = run_unconstrained(engine, jobs, lengths)
        con, mask = run_constrained(engine, jobs)
    if [r["output_tokens"] for r in sorted(con.requests, key=lambda r: int(r["id"][1:]))] != lengths:
        print("note: a constrained output's length changed between passes (tokens/s still compares like for like)", flush=True)
    return con, plain, mask


def check_outputs(engine, jobs, max_check: int = 64) -> dict:
    """Runs the constrained jobs once more, alone, to read their text: finished and valid counts."""
    import jsonschema

    reqs = []
    for k, (ids, p, s) in enumerate(jobs[: 2 * max_check]):
        if s is not None:
            reqs.append((engine.add_request(f"v{k}", ids, p), s))
    while engine.has_unfinished():
        engine.step()
    stop = valid = 0
    for req, schema in reqs:
        seq = req.seqs[0]
        if seq.finish_reason != "stop":
            continue
        stop += 1
        try:
            jsonschema.validate(json.loads(engine.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return {"constrained_jobs": len(reqs), "finished_stop": stop, "stop_and_valid": valid}


def main(argv: list[str] | None = None) -> dict:
    ap = report.parser(__doc__, quick_help="16 jobs, outputs 32-96 tokens, 2 rounds")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-output", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-memory-mib", type=float, default=256)
    args = ap.parse_args(argv)
    if args.quick:
        ap.set_defaults(num_requests=16, max_output=96, rounds=2)
        args = ap.parse_args(argv)

    engine = drive.new_engine(args.model, args.device, args.dtype, args.kv_memory_mib, max_num_seqs=256)
    tok = engine.tokenizer
    items = workloads.mixed(tok, num=args.num_requests, seed=args.seed, output_range=(min(32, args.max_output), args.max_output))
    jobs = constrained_items(tok, items)
    result = report.meta(str(engine.runner.device), str(engine.runner.dtype))
    # compile the schemas up front (what a repeat job sees), and warm the engine up
    for s in SCHEMAS:
        engine.grammars.validate(StructuredOutputsParams(json=s, disable_any_whitespace=True))
    compile_stats = engine.grammars.stats()
    drive.warm_up(engine)
    result["workload"] = {"requests": len(jobs), "constrained": sum(s is not None for _, _, s in jobs), "prompt_tokens": sum(len(i) for i, _, _ in jobs)}
    # an untimed constrained pass: the output lengths the unconstrained runs reproduce, and every
    # batch shape seen once (oneDNN builds a primitive per new shape: a first run pays for it)
    print(f"warm-up: {len(jobs)} jobs constrained (untimed) ...", flush=True)
    warm, _ = report.run_threaded(run_constrained, engine, jobs, "w")
    lengths = [r["output_tokens"] for r in sorted(warm.requests, key=lambda r: int(r["id"][1:]))]
    rounds = []
    for r in range(args.rounds):
        first = r % 2 == 1  # alternate which run goes first
        print(f"round {r + 1}/{args.rounds}: {len(jobs)} jobs, {'constrained' if first else 'unconstrained'} first ...", flush=True)
        con, plain, mask = report.run_threaded(run_round, engine, jobs, lengths, first)
        rounds.append({"constrained": con.summary(), "unconstrained": plain.summary(), "json_half": con.summary("json"), **mask})
    med = lambda key, run: statistics.median(x[run][key] for x in rounds)  # noqa: E731
    result["engine"] = {
        "constrained_tokens_per_s": med("tokens_per_s", "constrained"),
        "unconstrained_tokens_per_s": med("tokens_per_s", "unconstrained"),
        "output_tokens": rounds[0]["constrained"]["output_tokens"],
        "json_half_output_tokens": rounds[0]["json_half"]["output_tokens"],
        "mask_seconds": statistics.median(x["mask_seconds"] for x in rounds),
        "steps": statistics.median(x["steps"] for x in rounds),
        "masked_rows": statistics.median(x["masked_rows"] for x in rounds),
        "compile_seconds_up_front": compile_stats["grammar_compile_seconds"],
        "compilations_in_runs": sum(x["grammar_compilations"] for x in rounds),
    }
    e = result["engine"]
    e["ratio"] = e["constrained_tokens_per_s"] / e["unconstrained_tokens_per_s"]
    e["mask_ms_per_step"] = 1000 * e["mask_seconds"] / max(e["steps"], 1)
    result["rounds"] = rounds
    result["outputs"] = check_outputs(engine, jobs)
    report.publish(result, "structured_throughput", args.out, plot, markdown)
    return result


def markdown(r: dict) -> str:
    e, o = r["engine"], r["outputs"]
    rows = [
        ["half JSON schema (masked)", e["constrained_tokens_per_s"], e["output_tokens"], e["mask_ms_per_step"]],
        ["same jobs, unconstrained", e["unconstrained_tokens_per_s"], e["output_tokens"], 0.0],
    ]
    return "\n".join([
        report.header(r),
        "",
        report.table(["run", "output tok/s", "output tokens", "mask ms/step"], rows),
        "",
        f"ratio constrained / unconstrained: **{e['ratio']:.3f}**; grammars compiled up front in {e['compile_seconds_up_front']:.2f} s, "
        f"{e['compilations_in_runs']} compiles during the runs; constrained outputs: {o['finished_stop']}/{o['constrained_jobs']} finished \"stop\", "
        f"{o['stop_and_valid']} of those validate",
    ])


def plot(path: Path, r: dict) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    e = r["engine"]
    report.bars(ax, ["half JSON schema", "unconstrained"], [e["constrained_tokens_per_s"], e["unconstrained_tokens_per_s"]], "output tokens/s",
                f"structured output cost (ratio {e['ratio']:.3f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
