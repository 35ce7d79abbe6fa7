"""OpenAI batch lines without a broker: request mapping, and every shape the worker writes checked
with the ``openai`` package's own types (no extra fields either)."""

from __future__ import annotations

import copy

import orjson
import pytest

from qworker.messages import Choice, Completion, ErrorInfo, JobError, Timings, Usage
from qworker.openai_batch.requests import UNCAPPED, OpenAIRequest, RequestError, map_line
from qworker.openai_batch.results import STATUS, IdText, TokenizerText, completion_logprobs, error_line, output_line
from qworker.worker.decode import Invalid, Unparseable, Valid, decode
from qworker.worker.stream import StreamCoalescer, StreamEnd
from qworker.worker.wire import chunk_render

from .conftest import model_dir
from .openai_support import ErrorBody, validate_chunk, validate_line

CHAT = {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "smollm2", "messages": [{"role": "developer", "content": "Be brief."},
                                                  {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
                 "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": "\n", "seed": 3,
                 "frequency_penalty": 0.1, "presence_penalty": -0.2, "logprobs": True, "top_logprobs": 3,
                 "response_format": {"type": "json_object"}, "stream": True, "stream_options": {"include_usage": True},
                 "user": "u-1", "metadata": {"team": "a"}}}
COMPLETION = {"custom_id": "t1", "method": "POST", "url": "/v1/completions", "body": {"model": "smollm2", "prompt": "Once", "max_tokens": 4, "logprobs": 2, "stop": ["a", "b"]}}


def line(base: dict, **body) -> dict:
    out = copy.deepcopy(base)
    out["body"].update(body)
    return out


def test_chat_line_maps_every_field() -> None:
    job, wire = map_line(CHAT, now=1000.9)
    assert job.id == "c1" and job.model == "smollm2" and job.stream
    assert [m.model_dump() for m in job.messages] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]
    s = job.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.n, s.stop, s.seed) == (7, 0.5, 0.9, 2, ["\n"], 3)
    assert (s.frequency_penalty, s.presence_penalty, s.logprobs) == (0.1, -0.2, 3)
    assert job.response_format == {"type": "json_object"} and job.metadata == {"team": "a"}
    assert wire == OpenAIRequest("c1", "chat", 3, True, True, 1000, {"team": "a"})


def test_completion_line_maps_prompt_forms_and_defaults() -> None:
    job, wire = map_line(COMPLETION)
    assert job.prompt == "Once" and job.sampling.max_tokens == 4 and job.sampling.logprobs == 2 and job.sampling.stop == ["a", "b"]
    assert wire.endpoint == "completions" and wire.logprobs == 2 and not wire.stream
    assert map_line(line(COMPLETION, prompt=["Once"]))[0].prompt == "Once"
    assert map_line(line(COMPLETION, prompt=[1, 2, 3]))[0].prompt_token_ids == [1, 2, 3]
    assert map_line(line(COMPLETION, prompt=[[4, 5]]))[0].prompt_token_ids == [4, 5]
    bare = {"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "p"}}
    assert map_line(bare)[0].sampling.max_tokens == 16  # OpenAI's completions default
    chat = {"custom_id": "y", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "q"}]}}
    job, wire = map_line(chat)
    assert job.sampling.max_tokens == UNCAPPED and wire.logprobs is None  # chat: the context ends it
    # logprobs true without top_logprobs: the sampled token's logprob only
    assert map_line(line(chat, logprobs=True))[1].logprobs == 0


@pytest.mark.parametrize(("change", "param", "code"), [
    ({"tools": [{"type": "function"}]}, "body.tools", "unsupported_parameter"),
    ({"logit_bias": {"5": 101}}, "body.logit_bias.5", "invalid_job"),
    ({"prompt": "x"}, "body.prompt", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "body.messages[0].name", "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "body.messages[0].content[0].type", "unsupported_parameter"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "body.messages[0].role", "unsupported_parameter"),
    ({"messages": []}, "body.messages", "invalid_job"),
    ({"logprobs": False, "top_logprobs": 2}, "body.top_logprobs", "invalid_job"),
    ({"logprobs": 3}, "body.logprobs", "invalid_job"),
    ({"max_tokens": 5, "max_completion_tokens": 6}, "body.max_tokens", "invalid_job"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "body.stream_options", "invalid_job"),
    ({"stream_options": {"include_usage": True, "chunk_size": 3}}, "body.stream_options.chunk_size", "unsupported_parameter"),
    ({"n": 99}, "body.n", "invalid_job"),
    ({"temperature": "hot"}, "body.temperature", "invalid_job"),
    ({"max_completion_tokens": 0}, "body.max_completion_tokens", "invalid_job"),
    ({"metadata": {"k": 5}}, "body.metadata.k", "invalid_job"),
    ({"messages": [{"role": "user", "content": 5}]}, "body.messages[0].content", "invalid_job"),
])
def test_chat_refusals_name_the_field(change: dict, param: str, code: str) -> None:
    with pytest.raises(RequestError) as e:
        map_line(line(CHAT, **change))
    assert (e.value.param, e.value.code) == (param, code)
    assert param in e.value.message


@pytest.mark.parametrize(("change", "param"), [
    ({"logprobs": True}, "body.logprobs"),
    ({"top_logprobs": 2}, "body.top_logprobs"),
    ({"max_completion_tokens": 3}, "body.max_completion_tokens"),
    ({"prompt": ["a", "b"]}, "body.prompt"),
    ({"prompt": []}, "body.prompt"),
    ({"echo": True}, "body.echo"),
    ({"suffix": "end"}, "body.suffix"),
    ({"best_of": 3}, "body.best_of"),
    ({"messages": [{"role": "user", "content": "x"}]}, "body.messages"),
    ({"stop": [""]}, "body.stop[0]"),
])
def test_completion_refusals_name_the_field(change: dict, param: str) -> None:
    with pytest.raises(RequestError) as e:
        map_line(line(COMPLETION, **change))
    assert e.value.param == param, e.value.message


@pytest.mark.parametrize(("top", "param"), [({"method": "GET"}, "method"), ({"url": "/v1/embeddings"}, "url"), ({"body": []}, "body"), ({"header": {}}, "header")])
def test_line_envelope_refusals(top: dict, param: str) -> None:
    with pytest.raises(RequestError) as e:
        map_line({**COMPLETION, **top})
    assert e.value.param == param


def test_neutral_values_and_nulls_ask_for_nothing() -> None:
    job, _ = map_line(line(COMPLETION, echo=False, best_of=1, logit_bias={}, suffix="", seed=None, user=None, stream_options=None))
    assert job.prompt == "Once" and job.sampling.seed is None
    job, _ = map_line(line(CHAT, tools=[], messages=[{"role": "assistant", "content": "a", "tool_calls": [], "refusal": None}, {"role": "user", "content": "b"}]))
    assert [m.role for m in job.messages] == ["assistant", "user"]


def test_decode_tells_the_formats_apart() -> None:
    d = decode(orjson.dumps(COMPLETION))
    assert isinstance(d, Valid) and d.wire is not None and d.job.id == "t1"
    d = decode(b'{"id": "n1", "prompt": "x"}')
    assert isinstance(d, Valid) and d.wire is None
    d = decode(orjson.dumps(line(COMPLETION, tools=[1])))
    assert isinstance(d, Invalid) and d.job_id == "t1" and d.wire is not None and d.code == "unsupported_parameter" and d.param == "body.tools"
    for cid in (None, 5, "", "x" * 257):
        d = decode(orjson.dumps({**COMPLETION, "custom_id": cid}))
        assert isinstance(d, Unparseable) and d.code == "no_id", cid  # no key to answer by: the DLQ, as native
    d = decode(b'{"id": "both", "custom_id": "both", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}')
    assert isinstance(d, Invalid) and d.param == "id"  # a line with an id is not a native job


# ---------------------------------------------------------------------------- results
@pytest.fixture(scope="module")
def tokenizer():
    d = model_dir()
    if d is None:
        pytest.skip("test model missing")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))


def native(tokenizer, text: str, finish: str = "stop", n_alt: int = 2, status: str = "ok") -> Completion:
    ids = tokenizer.encode(text)
    lps = [{str(t): -0.5, **{str((t + k) % 1000): -1.0 - k for k in range(1, n_alt + 1)}} for t in ids]
    return Completion(job_id="c1", attempt=3, run_id="r1", status=status, model="smollm2-135m",
                      choices=[Choice(index=i, text=text, token_ids=ids, finish_reason=finish, logprobs=lps) for i in range(2)],
                      usage=Usage(prompt_tokens=11, completion_tokens=2 * len(ids), cached_tokens=5), timings=Timings(total_s=1.0))


def test_chat_completion_line_validates_with_openai_types(tokenizer) -> None:
    text = "Héllo, wörld ✓"  # multi-byte characters split across byte-level tokens
    ctx = OpenAIRequest("c1", "chat", 2, created=1234, metadata={"team": "a"})
    out = output_line(native(tokenizer, text), ctx, TokenizerText(tokenizer))
    cc = validate_line(out)
    assert out["custom_id"] == "c1" and out["response"]["status_code"] == 200 and out["id"] == "batch_req_r1"
    assert cc.id == "chatcmpl-r1" and cc.created == 1234 and cc.model == "smollm2-135m" and cc.metadata == {"team": "a"}
    assert [c.message.content for c in cc.choices] == [text, text] and cc.choices[0].finish_reason == "stop"
    assert (cc.usage.prompt_tokens, cc.usage.completion_tokens, cc.usage.total_tokens) == (11, cc.usage.completion_tokens, 11 + cc.usage.completion_tokens)
    assert cc.usage.prompt_tokens_details.cached_tokens == 5
    content = cc.choices[0].logprobs.content
    assert bytes(b for t in content for b in t.bytes).decode() == text  # the bytes rebuild the text exactly
    assert all(t.logprob == -0.5 and len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == -0.5 for t in content)


def test_text_completion_line_validates_with_openai_types(tokenizer) -> None:
    text = "one two"
    ctx = OpenAIRequest("t1", "completions", 1, created=5)
    out = output_line(native(tokenizer, text, finish="length"), ctx, TokenizerText(tokenizer))
    c = validate_line(out)
    assert c.object == "text_completion" and c.id == "cmpl-r1" and c.choices[1].text == text and c.choices[0].finish_reason == "length"
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == text and lp.token_logprobs == [-0.5] * len(lp.tokens)
    assert all(len(t) == 1 for t in lp.top_logprobs) and lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # without a tokenizer (collect converting a native result): vLLM's token_id:<id>, no bytes
    out = output_line(native(tokenizer, text), OpenAIRequest("t1", "chat", 0), IdText())
    tok = validate_line(out).choices[0].logprobs.content[0]
    assert tok.token.startswith("token_id:") and tok.bytes is None and tok.top_logprobs == []


def test_no_logprobs_unless_asked(tokenizer) -> None:
    cc = validate_line(output_line(native(tokenizer, "hi"), OpenAIRequest("c1", "chat", None), IdText()))
    assert all(c.logprobs is None for c in cc.choices)


@pytest.mark.parametrize("code", sorted(STATUS))
def test_error_lines_validate_and_carry_status(code: str) -> None:
    msg = JobError(job_id="e1", attempt=1, run_id="r9", error=ErrorInfo(code=code, message=f"{code} happened", retryable=False))
    out = output_line(msg, OpenAIRequest("e1"), IdText(), param="body.n" if code == "invalid_job" else None)
    body = validate_line(out)
    assert isinstance(body, ErrorBody) and out["response"]["status_code"] == STATUS[code] and out["error"]["code"] == code
    assert body.error.type == ("server_error" if STATUS[code] >= 500 else "invalid_request_error")
    field = {"invalid_job": "body.n", "invalid_structured_output": "body.response_format",
             "prompt_too_long": "body.messages", "invalid_prompt": "body.messages", "empty_prompt": "body.messages"}
    assert body.error.param == field.get(code)


def test_cancelled_completion_is_an_error_line(tokenizer) -> None:
    out = output_line(native(tokenizer, "par", finish="cancelled", status="cancelled"), OpenAIRequest("c1"), IdText())
    validate_line(out)
    assert out["response"]["status_code"] == 499 and out["error"]["code"] == "cancelled"
    assert error_line("x", "some_new_engine_code", "m")["response"]["status_code"] == 400


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_chunks_validate_roles_ends_usage_and_replay(endpoint: str) -> None:
    ctx = OpenAIRequest("s1", endpoint, None, True, True, 77)
    render = chunk_render(ctx, "smollm2-135m")
    co = StreamCoalescer("s1", 2, "run-a", 0.0)
    co.add(0, "Hel", [1])
    co.add(1, "Wor", [2])
    events = co.take()
    co.add(0, "lo", [3])
    events += co.take()
    co.end({0: "stop", 1: "length"}, Usage(prompt_tokens=4, completion_tokens=3, cached_tokens=0))
    events += co.take()
    assert [e.seq for e in events] == list(range(6)) and isinstance(events[-1], StreamEnd)
    rendered = [render(e) for e in events]
    chunks = [orjson.loads(v) for v, _ in rendered]
    for c in chunks:
        validate_chunk(c)
    assert {c["id"] for c in chunks} == {("chatcmpl-" if endpoint == "chat" else "cmpl-") + "run-a"}
    assert all(dict(h)["qworker.run_id"] == b"run-a" and dict(h)["qworker.attempt"] == b"2" for _, h in rendered)
    assert [int(dict(h)["qworker.seq"]) for _, h in rendered] == list(range(6))
    *content, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 7
    assert all(c["usage"] is None for c in content)
    ends = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in content if c["choices"][0]["finish_reason"]}
    assert ends == {0: "stop", 1: "length"}
    if endpoint == "chat":
        assert [c["choices"][0]["delta"] for c in content] == [{"role": "assistant", "content": "Hel"}, {"role": "assistant", "content": "Wor"}, {"content": "lo"}, {}, {}]
    else:
        assert "".join(c["choices"][0]["text"] for c in content if c["choices"][0]["index"] == 0) == "Hello"
    # a replay (fresh run id) repeats everything, the roles and ends included, under new ids
    replay = [orjson.loads(render(e)[0]) for e in co.restart("run-b")]
    assert {c["id"] for c in replay} == {("chatcmpl-" if endpoint == "chat" else "cmpl-") + "run-b"}
    assert len(replay) == 5 and replay[-1]["usage"]["total_tokens"] == 7
    if endpoint == "chat":
        assert replay[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hello"}


def test_schema_examples_are_what_the_worker_does() -> None:
    from qworker import schemas_gen

    ex = schemas_gen.openai_examples()
    ins, outs = ex["batch_input"], ex["batch_output"]
    assert len(ins) == len(outs) and [ln.get("custom_id", ln.get("id")) for ln in ins] == [o["custom_id"] for o in outs]
    for ln, out in zip(ins, outs):
        validate_line(out)
        d = decode(orjson.dumps(ln))
        assert isinstance(d, Valid) == (out["response"]["status_code"] == 200)
    assert schemas_gen.diff() == []


def test_the_runtime_never_imports_openai() -> None:
    import subprocess
    import sys

    code = ("import sys, qworker.cli, qworker.worker, qworker.openai_batch.transfer, qworker.schemas_gen; "
            "qworker.schemas_gen.openai_examples(); print('openai' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_an_answer_too_large_in_openai_shape_becomes_a_413_line() -> None:
    """The size limit applies to the bytes that go out: the OpenAI shape (token strings, bytes)
    is larger than the native message, so it is measured, not the native one."""
    from qworker.config import WorkerSettings
    from qworker.worker import Worker
    from qworker.worker.wire import shape

    w = Worker(WorkerSettings(max_message_bytes=16_384))
    ids = list(range(1000, 1600))
    msg = Completion(job_id="big", attempt=1, run_id="r", model="m", choices=[Choice(index=0, text="x" * 600, token_ids=ids, finish_reason="length",
                                                                                         logprobs=[{str(t): -1.0} for t in ids])],
                     usage=Usage(prompt_tokens=1, completion_tokens=600), timings=Timings(total_s=1.0))
    wire = OpenAIRequest("big", "chat", 0)
    native = len(msg.model_dump_json())
    assert native < 16_384 - 1024 < len(shape(wire, IdText())(msg))  # fits natively, not as OpenAI's
    out, data = w.answers.encoded(msg, None, shape(wire, IdText()))
    line = orjson.loads(data)
    validate_line(line)
    assert isinstance(out, JobError) and line["custom_id"] == "big" and line["response"]["status_code"] == 413 and line["error"]["code"] == "result_too_large"


@pytest.mark.parametrize("words", ["ok 😀😀 done", "日本語の文章です。", "a🙂b", "plain ascii text", "ünïcödé ✓ 𝄞 end"])
def test_text_offsets_are_character_offsets_in_the_text(tokenizer, words: str) -> None:
    """Each token's offset is where its text starts in the completion's text, also after a
    character split over tokens (helper-52: each piece was decoded alone, a split emoji counted as
    two or three U+FFFD, and later offsets pointed past the end of the text)."""
    ids = tokenizer.encode(words, add_special_tokens=False)
    assert tokenizer.decode(ids) == words
    offsets = completion_logprobs(ids, [{str(i): -0.5} for i in ids], 0, TokenizerText(tokenizer))["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(words)
    for i, at in enumerate(offsets):  # the text before a token is what the tokens before it spell
        assert words[:at] == tokenizer.decode(ids[:i]).rstrip("\ufffd"), (i, at)


@pytest.mark.parametrize(("endpoint", "message", "param"), [
    ("chat", "logit_bias token ids out of range [0, 49152): [999999]", "body.logit_bias"),
    ("completions", "stop_token_ids out of range [0, 49152): [-1]", "body.stop_token_ids"),
    ("chat", "min_tokens 9000 exceeds the 100 tokens of context left after the prompt", "body.min_tokens"),
    ("chat", "params must be a SamplingParams", None),
])
def test_a_sampling_refusal_names_the_field_its_message_starts_with(endpoint: str, message: str, param) -> None:
    msg = JobError(job_id="e1", attempt=1, run_id="r9", error=ErrorInfo(code="invalid_sampling", message=message, retryable=False))
    assert validate_line(output_line(msg, OpenAIRequest("e1", endpoint), IdText())).error.param == param


def test_a_made_up_answer_id_is_nobody_elses_and_is_text() -> None:
    """helper-118: a line with no usable id answered as ``line-<N>`` even where another line's
    custom_id was ``line-<N>`` (two output lines, one id); and a custom_id with a lone surrogate
    was echoed into an output line no JSON parser reads back."""
    import orjson

    from qworker.openai_batch.files import local_answer, read_lines

    ok = b'{"custom_id": "line-2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 1}}'
    taken = b'{"custom_id": "line-2~2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "y", "max_tokens": 1}}'
    lines = read_lines(ok + b"\n{oops\n" + taken + b'\n{"custom_id": "\\ud800x"}\n')
    assert [ln.answer_id for ln in lines] == ["line-2", "line-2~3", "line-2~2", "line-4"]
    assert len({ln.answer_id for ln in lines}) == len(lines)
    for ln in lines[1::2]:  # the two never submitted: their error lines parse
        assert orjson.loads(orjson.dumps(local_answer(ln)))["custom_id"] == ln.answer_id
