"""Generate ``schemas/``: one versioned JSON Schema per message type plus example messages.

``python -m qworker.schemas_gen [--check] [DIR]`` writes ``DIR/<type>.v<N>.json`` and
``DIR/examples/<name>.json``; ``--check`` writes nothing and exits 1 when the files differ from
what the models produce (the test suite runs the same comparison).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson

from qworker.messages import (
    MESSAGE_TYPES,
    SCHEMA_VERSION,
    Cancel,
    ChatMessage,
    Choice,
    Completion,
    Delta,
    ErrorInfo,
    Job,
    JobError,
    Sampling,
    Timings,
    Usage,
)

DEFAULT_DIR = Path(__file__).resolve().parent.parent / "schemas"
ID_BASE = "https://qworker.dev/schemas"


# a job gives exactly one of these, as a value that is not null (Job._one_prompt)
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")


def _close_pattern_objects(node: Any) -> None:
    """An object schema whose keys must match ``patternProperties`` (logit_bias's token ids) takes
    no other key, as the model refuses one: JSON Schema's default would accept ``{"abc": 1}``."""
    if isinstance(node, dict):
        if "patternProperties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for value in node.values():
            _close_pattern_objects(value)
    elif isinstance(node, list):
        for value in node:
            _close_pattern_objects(value)


def schema_for(name: str) -> dict[str, Any]:
    model = MESSAGE_TYPES[name]
    schema = model.model_json_schema(mode="validation" if name in ("job", "cancel") else "serialization")
    _close_pattern_objects(schema)
    if name == "job":  # what the model's validator says, in the schema's terms
        schema["oneOf"] = [{"required": [f], "properties": {f: {"not": {"type": "null"}}}} for f in PROMPT_FIELDS]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"{ID_BASE}/{name}.v{SCHEMA_VERSION}.json",
        **schema,
    }


def examples() -> dict[str, Any]:
    """Example messages; each is validated against its model so they cannot drift."""
    meta = {"tenant": "acme", "trace": "abc123"}
    ex = {
        "job.prompt": Job(id="job-1", prompt="Write a haiku about queues.", sampling=Sampling(max_tokens=32, temperature=0.0), stream=True, metadata=meta),
        "job.chat": Job(
            id="job-2",
            messages=[ChatMessage(role="system", content="You are terse."), ChatMessage(role="user", content="What is Kafka?")],
            sampling=Sampling(max_tokens=64, temperature=0.7, top_p=0.9, seed=42, stop=["\n\n"]),
            priority=-1,
            deadline=1893456000.0,
        ),
        "job.lora": Job(id="job-7", prompt="SELECT", lora="sql-lora", sampling=Sampling(max_tokens=32, temperature=0.0)),
        "job.json_schema": Job(
            id="job-6",
            messages=[ChatMessage(role="user", content="Extract: John Smith, 42, a VIP customer from Boston.")],
            sampling=Sampling(max_tokens=96, temperature=0.0),
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "person",
                    "strict": True,
                    "schema": {
                        "type": "object",
                        "properties": {
                            "name": {"type": "string", "maxLength": 40},
                            "age": {"type": "integer", "minimum": 0, "maximum": 130},
                            "tags": {"type": "array", "items": {"enum": ["customer", "vip", "new"]}, "maxItems": 3},
                        },
                        "required": ["name", "age"],
                    },
                },
            },
        ),
        "error.structured": JobError(job_id="job-7", attempt=1, run_id="", error=ErrorInfo(
            code="invalid_structured_output", message="invalid json: Unsupported type \"strin\"", retryable=False)),
        "job.token_ids": Job(id="job-3", prompt_token_ids=[1, 9690, 198], sampling=Sampling(max_tokens=8, n=2, temperature=0.8, seed=7)),
        "delta": Delta(job_id="job-1", attempt=3, run_id="7f3a9c21", index=0, seq=0, text="Messages wait", token_ids=[40335, 3875]),
        "completion": Completion(
            job_id="job-1",
            attempt=3,
            run_id="7f3a9c21",
            model="smollm2-135m",
            choices=[Choice(index=0, text="Messages wait in line", token_ids=[40335, 3875, 281, 1627], finish_reason="length")],
            usage=Usage(prompt_tokens=12, completion_tokens=4, cached_tokens=0),
            timings=Timings(queue_s=0.012, ttft_s=0.081, total_s=0.31),
            metadata=meta,
            last_seq=1,  # its stream (job-1 streams): the delta example is seq 0, one more event follows
        ),
        "completion.cancelled": Completion(
            job_id="job-4",
            attempt=3,
            run_id="0c1d2e3f",
            status="cancelled",
            model="smollm2-135m",
            choices=[Choice(index=0, text="Once upon", token_ids=[11142, 2033], finish_reason="cancelled")],
            usage=Usage(prompt_tokens=9, completion_tokens=2),
            timings=Timings(queue_s=0.01, ttft_s=0.09, total_s=0.4),
        ),
        "error": JobError(job_id="job-5", attempt=3, run_id="", error=ErrorInfo(code="prompt_too_long", message="prompt has 9000 tokens; the model's context is 8192", retryable=False)),
        "cancel": Cancel(job_id="job-4", reason="user closed the tab"),
    }
    return {k: v.model_dump(mode="json", exclude_defaults=k.startswith("job") or k == "cancel") for k, v in ex.items()}


def openai_examples() -> dict[str, list[dict[str, Any]]]:
    """An OpenAI batch input file and the output ``collect`` writes for it (one line each, in
    order). Every request line is mapped as the worker maps it and every answer shaped by the
    worker's own code, so the examples cannot drift from what runs."""
    from qworker.openai_batch.requests import OpenAIRequest, map_line
    from qworker.openai_batch.results import output_line

    class Pieces:  # the pieces SmolLM2's tokenizer gives for these ids (the worker asks the tokenizer)
        spells_text = True
        pieces = {59: "K", 35432: "afka", 314: " is", 253: " a", 7042: " Paris", 30: ".", 28: ",", 198: "\n", 2: "<|im_end|>", 665: " there", 436: " was"}

        def piece(self, token_id: int) -> tuple[str, list[int] | None]:
            t = self.pieces[token_id]
            return t, list(t.encode())

    chat = {"custom_id": "request-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2-135m", "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is Kafka?"}],
                     "max_completion_tokens": 4, "temperature": 0}}
    text = {"custom_id": "request-2", "method": "POST", "url": "/v1/completions",
            "body": {"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "logprobs": 1}}
    bad = {"custom_id": "request-3", "method": "POST", "url": "/v1/chat/completions",
           "body": {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}}
    native = Job(id="request-4", prompt="Once upon a time", sampling=Sampling(max_tokens=2, temperature=0.0))
    inputs = [chat, text, bad, native.model_dump(mode="json", exclude_defaults=True)]
    wires = [map_line(chat, now=1767225600)[1], map_line(text, now=1767225600)[1]]

    def done(jid: str, run: str, out: str, ids: list[int], lps: list[dict[str, float]] | None = None) -> Completion:
        return Completion(job_id=jid, attempt=1, run_id=run, model="smollm2-135m", choices=[Choice(index=0, text=out, token_ids=ids, finish_reason="length", logprobs=lps)],
                          usage=Usage(prompt_tokens=30, completion_tokens=len(ids), cached_tokens=16), timings=Timings(total_s=0.2))

    outputs = [
        output_line(done("request-1", "5d1c0a9e7b3f2a10", "Kafka is a", [59, 35432, 314, 253]), wires[0], Pieces()),
        output_line(done("request-2", "8e2b4f6a1c3d5e70", " Paris.\n", [7042, 30, 198], [{"7042": -0.11, "253": -2.6}, {"30": -0.4, "28": -1.5}, {"198": -0.9, "2": -1.0}]), wires[1], Pieces()),
        output_line(JobError(job_id="request-3", attempt=1, run_id="3c4d5e6f7a8b9c0d", error=ErrorInfo(code="unsupported_parameter", message="body.tools is not supported on /v1/chat/completions",
                                                                            retryable=False)), OpenAIRequest("request-3"), Pieces(), param="body.tools"),
        output_line(done("request-4", "0a9b8c7d6e5f4a3b", " there was", [665, 436]), OpenAIRequest("request-4", "completions", created=1767225600), Pieces()),
    ]
    return {"batch_input": inputs, "batch_output": outputs}


def render() -> dict[str, bytes]:
    """Relative path -> file bytes for everything under ``schemas/``."""
    opts = orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE
    files = {f"{name}.v{SCHEMA_VERSION}.json": orjson.dumps(schema_for(name), option=opts) for name in MESSAGE_TYPES}
    for name, data in examples().items():
        files[f"examples/{name}.json"] = orjson.dumps(data, option=opts)
    for name, lines in openai_examples().items():
        files[f"examples/openai/{name}.jsonl"] = b"".join(orjson.dumps(x, option=orjson.OPT_APPEND_NEWLINE) for x in lines)
    return files


def write(directory: Path = DEFAULT_DIR) -> list[Path]:
    written = []
    for rel, data in render().items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written.append(path)
    return written


def diff(directory: Path = DEFAULT_DIR) -> list[str]:
    """Files that are missing or differ from the models (extra stale schema files count too)."""
    want = render()
    bad = [rel for rel, data in want.items() if not (directory / rel).exists() or (directory / rel).read_bytes() != data]
    have = {str(p.relative_to(directory)) for pat in ("*.json", "*.jsonl") for p in directory.rglob(pat)} if directory.exists() else set()
    bad += sorted(have - set(want))
    return bad


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    check = "--check" in args
    args = [a for a in args if a != "--check"]
    directory = Path(args[0]) if args else DEFAULT_DIR
    if check:
        bad = diff(directory)
        for rel in bad:
            print(f"out of date: {directory / rel}")
        return 1 if bad else 0
    for path in write(directory):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
