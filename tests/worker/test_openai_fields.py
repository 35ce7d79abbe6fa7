"""OpenAI batch body fields: ``logit_bias`` is served (it was refused), the README's one table
says exactly which fields are accepted, ignored or refused, and ``submit`` names ``custom_id``
when an OpenAI-shaped line lacks it (it said ``id``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from qworker.engine import SamplingParams
from qworker.openai_batch.files import classify, local_answer
from qworker.openai_batch.requests import CHAT_FIELDS, COMPLETIONS_FIELDS, NEUTRAL, RequestError, map_line
from qworker.worker import Worker
from qworker.worker.client import submit

from .conftest import REPO, needs_engine
from .test_openai_worker import ByKey, completion

README = (REPO / "README.md").read_text()
BATCH = README.split("### OpenAI batch files", 1)[1].split("\n### ", 1)[0]


def line(url: str, **body) -> dict:
    base = {"messages": [{"role": "user", "content": "hi"}]} if url.endswith("chat/completions") else {"prompt": "hi"}
    return {"custom_id": "c1", "method": "POST", "url": url, "body": {**base, **body}}


CHAT, CMPL = "/v1/chat/completions", "/v1/completions"


@pytest.mark.parametrize("url", [CHAT, CMPL])
def test_logit_bias_reaches_the_engine_keyed_by_token_id(url: str) -> None:
    job, _ = map_line(line(url, logit_bias={"50256": -100, "13": 5}))
    kw = job.sampling.engine_kwargs()
    assert kw["logit_bias"] == {50256: -100.0, 13: 5.0}
    assert SamplingParams(**kw).logit_bias == {50256: -100.0, 13: 5.0}
    assert "logit_bias" not in map_line(line(url, logit_bias={}))[0].sampling.engine_kwargs()  # asks for nothing


@pytest.mark.parametrize("bias, says", [
    ({"13": 100.5}, "less than or equal to 100"), ({"13": -101}, "greater than or equal to -100"), ({"x": 1}, "pattern"),
    ({"13": "1"}, "valid number"), ([13], "dictionary"), ({str(i): 1 for i in range(301)}, "at most 300"),
])
def test_a_bad_logit_bias_is_refused_naming_it(bias, says: str) -> None:
    with pytest.raises(RequestError) as e:
        map_line(line(CHAT, logit_bias=bias))
    assert e.value.code == "invalid_job" and e.value.param.startswith("body.logit_bias") and says in e.value.message


def table_rows() -> list[tuple[list[str], str, str]]:
    """(field names, endpoint, verdict) of each row of the README's one body-field table."""
    head = BATCH.index("| body field | endpoint | qworker |")
    rows = []
    for ln in BATCH[head:].splitlines()[2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        names = [] if "`" not in cells[0] or cells[0].startswith(("the other", "in a message", "any field")) else re.findall(r"`([a-z_]+)`", cells[0])
        rows.append((names, cells[1], cells[2]))
    return rows


def test_the_table_is_the_whole_list() -> None:
    rows = table_rows()
    assert sum(1 for ln in BATCH.splitlines() if ln.startswith("| body field")) == 1, "one table"
    accepted = {n for names, _, v in rows if v == "accepted" for n in names}
    ignored = {n for names, _, v in rows if v.startswith("ignored") for n in names}
    refused = {n for names, _, v in rows if v == "refused" for n in names}
    assert accepted | {"user"} == CHAT_FIELDS | COMPLETIONS_FIELDS  # user: taken and not used
    assert ignored - {"user"} == set(NEUTRAL)
    assert "logit_bias" in accepted and not (accepted & refused) and not (ignored & refused)
    for f in refused | (ignored - {"user"}):
        for url in (CHAT, CMPL):
            with pytest.raises(RequestError) as e:
                map_line(line(url, **{f: "something"}))
            assert (e.value.code, e.value.param) == ("unsupported_parameter", f"body.{f}")
    for f, values in NEUTRAL.items():
        for v in values:
            map_line(line(CHAT, **{f: v}))  # ignored at the value the table gives
            assert f"`{f}`" in BATCH
    assert "`logit_bias`, `echo`" not in BATCH and '"logit_bias": {}' not in BATCH  # no longer listed as refused


def test_an_openai_line_without_custom_id_is_told_so() -> None:
    raw = b'{"method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "hi"}]}}'
    got = classify(3, raw)
    assert got.key is None and "'custom_id'" in got.problem and "'id'" not in got.problem
    assert "custom_id" in local_answer(got)["error"]["message"]
    native = classify(4, b'{"prompt": "hi"}')
    assert "'id'" in native.problem  # a native job still lacks an id


@pytest.mark.parametrize("field", ["custom_id", "id"])
def test_a_line_nested_deeper_than_the_decoder_keeps_its_id(field: str) -> None:
    """helper-74: valid JSON nested past 1,024 levels was called "not valid JSON" and answered
    as ``line-N``, though it names its line (the worker, sent such a record, answers it under
    its id). Read without recursion, its id is the answer's."""
    from qworker.worker.decode import Invalid, decode

    deep = b"[" * 3000 + b"]" * 3000
    raw = b'{"%s": "deep-1", "method": "POST", "url": "/v1/chat/completions", "body": {"metadata": %s}}' % (field.encode(), deep)
    got = classify(7, raw)
    assert got.key is None, "not submitted"
    answer = local_answer(got)
    assert answer["custom_id"] == "deep-1" and answer["error"]["code"] == "invalid_job"
    assert "3002 levels deep" in answer["error"]["message"] and "not valid JSON" not in answer["error"]["message"]
    assert isinstance(worker := decode(raw), Invalid) and worker.job_id == "deep-1"
    for bad, why in ((deep, "not an object"), (b'{"custom_id": "x", "a": ' + deep[:-1], "not valid JSON")):
        line = classify(8, bad)
        assert why in line.problem and local_answer(line)["custom_id"] == "line-8"

def test_submit_names_custom_id(broker, tmp_path) -> None:
    f = tmp_path / "batch.jsonl"
    f.write_bytes(b'{"method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")}
    env.update(QWORKER_BOOTSTRAP_SERVERS=broker.bootstrap, QWORKER_ENABLE_IDEMPOTENCE="false")
    r = subprocess.run([sys.executable, "-m", "qworker.cli", "submit", "--file", str(f)], cwd=REPO, env=env, capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert "line 1: no usable 'custom_id'" in err and "'id'" not in err, err


@needs_engine
@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_logit_bias_line_answered_through_the_worker(real_engine, topics) -> None:
    eng, _ = real_engine
    forced = 282  # a token the greedy continuation would not pick every time
    lines = [
        completion("bias-forced", "The capital of France is", max_tokens=4, logit_bias={str(forced): 100}),
        completion("bias-oov", "The capital of France is", max_tokens=2, logit_bias={"1000000": 1}),
    ]
    w = Worker(topics, eng)
    await w.start()
    try:
        async with ByKey(topics) as got:
            await submit(topics, lines)
            await got.wait(len(lines), 90)
            out = {k: v[0][0] for k, v in got.answers.items()}
    finally:
        await w.stop()
    assert out["bias-forced"]["response"]["status_code"] == 200, out["bias-forced"]
    assert out["bias-forced"]["response"]["body"]["choices"][0]["text"] == eng.tokenizer.decode([forced] * 4)
    assert (out["bias-oov"]["response"]["status_code"], out["bias-oov"]["error"]["code"]) == (400, "invalid_sampling")
