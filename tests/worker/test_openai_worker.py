"""OpenAI batch request lines through the worker (real broker, SmolLM2, in-process): every record
on the result topics validates with the ``openai`` types, and greedy answers equal the native
contract's for the same prompts."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from qworker.worker import Worker
from qworker.worker.client import ResultReader, submit

from .conftest import wait_committed
from .openai_support import ErrorBody, validate_chunk, validate_line

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


def chat(cid: str, content: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": CHAT_URL, "body": {"messages": [{"role": "user", "content": content}], "temperature": 0, **body}}


def completion(cid: str, prompt: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": COMPLETIONS_URL, "body": {"prompt": prompt, "temperature": 0, **body}}


class ByKey:
    """Every record on the completions and tokens topics, by key, with its headers."""

    def __init__(self, s):
        self.s = s
        self.reader = ResultReader(s, [s.completions_topic, s.tokens_topic])
        self.answers: dict[str, list[tuple[dict, dict]]] = {}
        self.chunks: dict[str, list[tuple[dict, dict]]] = {}

    async def __aenter__(self) -> ByKey:
        await self.reader.start()
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        async for rec in self.reader.records():
            into = self.answers if rec.topic == self.s.completions_topic else self.chunks
            into.setdefault(rec.key.decode(), []).append((orjson.loads(rec.value), dict(rec.headers or ())))

    async def wait(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.answers) < n:
            assert time.monotonic() < deadline, f"{len(self.answers)} of {n} answered"
            await asyncio.sleep(0.05)

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.reader.stop()


async def test_openai_lines_answered_in_openai_shapes(real_engine, topics) -> None:
    eng, _ = real_engine
    lines = [
        chat("chat-plain", "Name a colour.", max_tokens=5),
        chat("chat-lp", "Name a colour.", max_completion_tokens=4, logprobs=True, top_logprobs=2),
        chat("chat-stream", "Say hi.", max_tokens=6, stream=True, stream_options={"include_usage": True}, metadata={"k": "v"}),
        completion("cmpl-plain", "The capital of France is", max_tokens=5),
        completion("cmpl-lp", "The capital of France is", max_tokens=4, logprobs=3, stream=True),
        completion("cmpl-ids", [504, 3458, 282], max_tokens=3),
        chat("bad-tools", "x", tools=[{"type": "function", "function": {"name": "f"}}]),
        {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        chat("bad-model", "x", model="gpt-9", max_tokens=2),
        completion("too-long", "word " * (eng.max_model_len + 10), max_tokens=2),
        chat("json", "Give a person as JSON.", max_tokens=6, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}}}),
        chat("bad-schema", "x", max_tokens=2, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}),
    ]
    natives = [  # the same prompts in the native contract
        {"id": "n-chat", "messages": [{"role": "user", "content": "Name a colour."}], "sampling": {"max_tokens": 5, "temperature": 0.0}},
        {"id": "n-cmpl", "prompt": "The capital of France is", "sampling": {"max_tokens": 5, "temperature": 0.0}},
    ]
    w = Worker(topics, eng)
    await w.start()
    try:
        async with ByKey(topics) as got:
            await submit(topics, lines + natives)
            await got.wait(len(lines) + len(natives), 90)
            out = {k: v[0][0] for k, v in got.answers.items()}
            heads = {k: v[0][1] for k, v in got.answers.items()}
            for ln in lines:
                validate_line(out[ln["custom_id"]])
                assert out[ln["custom_id"]]["custom_id"] == ln["custom_id"]
                assert heads[ln["custom_id"]]["qworker.attempt"].isdigit() and "qworker.run_id" in heads[ln["custom_id"]]
            ok = {k: validate_line(out[k]) for k in ("chat-plain", "chat-lp", "chat-stream", "cmpl-plain", "cmpl-lp", "cmpl-ids")}
            # greedy: the OpenAI answer is the native answer
            n_chat, n_cmpl = got.answers["n-chat"][0][0], got.answers["n-cmpl"][0][0]
            assert n_chat["type"] == n_cmpl["type"] == "completion"
            assert ok["chat-plain"].choices[0].message.content == n_chat["choices"][0]["text"]
            assert ok["chat-plain"].choices[0].finish_reason == n_chat["choices"][0]["finish_reason"]
            assert ok["cmpl-plain"].choices[0].text == n_cmpl["choices"][0]["text"]
            assert ok["chat-plain"].usage.prompt_tokens == n_chat["usage"]["prompt_tokens"]
            assert ok["chat-plain"].usage.completion_tokens == n_chat["usage"]["completion_tokens"]
            # logprobs in OpenAI's two shapes, tokens spelling the text
            lp = ok["chat-lp"].choices[0].logprobs.content
            assert bytes(b for t in lp for b in t.bytes).decode("utf-8", "replace") == ok["chat-lp"].choices[0].message.content
            assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in lp)
            clp = ok["cmpl-lp"].choices[0].logprobs
            assert len(clp.tokens) == len(clp.token_logprobs) == len(clp.top_logprobs) == len(clp.text_offset) == 4
            assert n_cmpl["choices"][0]["text"].startswith(ok["cmpl-lp"].choices[0].text)  # greedy: 4 tokens of the same 5
            assert ok["chat-stream"].metadata == {"k": "v"}
            # errors: status codes and the field named
            assert out["bad-tools"]["response"]["status_code"] == 400 and out["bad-tools"]["error"]["code"] == "unsupported_parameter"
            assert ErrorBody.model_validate(out["bad-tools"]["response"]["body"]).error.param == "body.tools"
            assert out["bad-url"]["response"]["status_code"] == 400 and "url" in out["bad-url"]["error"]["message"]
            assert (out["bad-model"]["response"]["status_code"], out["bad-model"]["error"]["code"]) == (404, "wrong_model")
            assert (out["too-long"]["response"]["status_code"], out["too-long"]["error"]["code"]) == (400, "prompt_too_long")
            # structured output: the native response_format, constrained from the first token
            assert "".join(validate_line(out["json"]).choices[0].message.content.split()).startswith('{"name"')
            assert (out["bad-schema"]["response"]["status_code"], out["bad-schema"]["error"]["code"]) == (400, "invalid_structured_output")
            # refusals made after the line was mapped name their field too (they said null)
            assert out["bad-schema"]["response"]["body"]["error"]["param"] == "body.response_format"
            assert out["too-long"]["response"]["body"]["error"]["param"] == "body.prompt"
            # streams: chunks with the answer's body id rebuild its text, end with finish and usage
            for key, text_of in (("chat-stream", lambda c: c["choices"][0]["delta"].get("content", "")), ("cmpl-lp", lambda c: c["choices"][0]["text"])):
                body = out[key]["response"]["body"]
                chunks = [(c, h) for c, h in got.chunks[key] if c["id"] == body["id"]]
                for c, h in chunks:
                    validate_chunk(c)
                    assert h["qworker.run_id"] == heads[key]["qworker.run_id"]
                assert [int(h["qworker.seq"]) for _, h in chunks] == list(range(len(chunks)))
                content = [c for c, _ in chunks if c["choices"]]
                assert "".join(text_of(c) for c in content) == (body["choices"][0]["message"]["content"] if key == "chat-stream" else body["choices"][0]["text"])
                assert content[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]
            usage = [c for c, _ in got.chunks["chat-stream"] if not c["choices"]]
            assert len(usage) == 1 and usage[0]["usage"] == out["chat-stream"]["response"]["body"]["usage"]
            assert not any(not c["choices"] for c, _ in got.chunks["cmpl-lp"])  # no include_usage: no usage chunk
        await wait_committed(topics)
    finally:
        await w.stop()


async def test_submit_follow_prints_native_and_openai_streams(real_engine, topics, tmp_path) -> None:
    """``qworker submit --follow`` (the flags it always had, and a file) prints the streamed text
    and each final answer, for both formats."""
    import os
    import sys

    from .conftest import REPO

    eng, refs = real_engine
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")}
    env.update({f"QWORKER_{f.upper()}": str(getattr(topics, f)) for f in ("bootstrap_servers", "jobs_topic", "tokens_topic", "completions_topic", "fetch_max_wait_ms")})
    env["QWORKER_ENABLE_IDEMPOTENCE"] = "false"
    batch = tmp_path / "b.jsonl"
    batch.write_bytes(orjson.dumps(chat("follow-chat", "Name a colour.", max_tokens=8, stream=True)) + b"\n")
    w = Worker(topics, eng)
    await w.start()
    try:
        flags = await asyncio.create_subprocess_exec(sys.executable, "-m", "qworker.cli", "submit", "-p", "The capital of France is", "--max-tokens", "8", "--follow",
                                                     "--id", "follow-native", cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(flags.communicate(), 60)
        assert flags.returncode == 0, err.decode()[-2000:]
        final = orjson.loads(out.decode().strip().splitlines()[-1])
        assert final["type"] == "completion" and final["choices"][0]["text"] == refs["plain"].text
        assert out.decode().startswith(refs["plain"].text + "\n")  # the whole stream, then the answer
        fromfile = await asyncio.create_subprocess_exec(sys.executable, "-m", "qworker.cli", "submit", "--file", str(batch), "--follow", cwd=REPO, env=env,
                                                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(fromfile.communicate(), 60)
        assert fromfile.returncode == 0, err.decode()[-2000:]
        final = orjson.loads(out.decode().strip().splitlines()[-1])
        body = validate_line(final)
        assert body.choices[0].message.content == refs["chat"].text and out.decode().startswith(refs["chat"].text + "\n")
        assert "submitted 1 of 1 lines (1 OpenAI, 0 native)" in err.decode()
    finally:
        await w.stop()
