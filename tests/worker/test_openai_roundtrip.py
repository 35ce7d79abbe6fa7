"""A 1,000-line batch file through the commands a user types: ``qworker run`` (a process, real
model), ``qworker submit --file`` and ``qworker collect`` (processes), on the real broker.

None of the three sets ``QWORKER_ENABLE_IDEMPOTENCE``: against Tansu they must fall back to a
non-idempotent producer with one warning, not die. Tiny ``max_tokens`` (1-4) keep it cheap."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import orjson
import pytest

from qworker.openai_batch.files import read_lines
from qworker.worker.client import create_topics

from .conftest import REPO, engine_available, make_settings, model_dir
from .openai_support import validate_line

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.skipif(not engine_available(), reason="engine or model missing")]

# longer than a KV block (16 tokens), so that repeats of a prompt are mostly served from the prefix cache
PROMPTS = [f"Item {i}: the colour of the sky on a clear summer day, seen from a quiet beach, is" for i in range(40)]


def request(cid: str, i: int, rng: random.Random) -> dict:
    n = i % 4 + 1
    prompt = PROMPTS[i % len(PROMPTS)]
    if i % 2:
        body = {"messages": [{"role": "user", "content": prompt}], "max_completion_tokens": n, "temperature": 0}
        if i % 7 == 0:
            body.update(logprobs=True, top_logprobs=2)
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0}
    if i % 10 == 0:
        body["logprobs"] = 1
    if i % 50 == 0:
        body["stream"] = True
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}


INVALID = [  # (the line, what its answer must say)
    (b'{"custom_id": "cut-short", "method": "POST", "url"', "not valid JSON"),
    (b'["an", "array"]', "not an object"),
    (orjson.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}), "no usable 'custom_id'"),
    (orjson.dumps({"custom_id": "x" * 300, "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}), "no usable 'custom_id'"),
]


def build(path) -> tuple[list[bytes], dict[str, str]]:
    """1,000 lines: OpenAI chat and completions lines, native twins of some, invalid lines of
    every kind. Returns the lines and {native twin id: OpenAI custom_id of the same request}."""
    rng = random.Random(15)
    lines: list[bytes] = []
    twins: dict[str, str] = {}
    i = 0
    while len(lines) < 1000:
        k = len(lines)
        if k % 25 == 3:
            lines.append(INVALID[(k // 25) % len(INVALID)][0])
        elif k % 25 == 9:
            bad = request(f"bad-{k}", i, rng)
            bad["body"].update(rng.choice([{"tools": [{"type": "function"}]}, {"n": 99}, {"suffix": "x"}, {"top_p": 0}]))
            lines.append(orjson.dumps(bad if bad["url"] == "/v1/completions" else {**bad, "url": "/v1/embeddings"}))
        elif k % 25 == 17:  # a native job asking what the previous OpenAI line asked
            prev = orjson.loads(lines[-1]) if lines and lines[-1].startswith(b'{"custom_id"') else None
            if prev is None or prev["url"] != "/v1/completions" or "logprobs" in prev["body"] or "stream" in prev["body"]:
                lines.append(orjson.dumps({"id": f"native-{k}", "prompt": PROMPTS[k % len(PROMPTS)], "sampling": {"max_tokens": 2, "temperature": 0.0}}))
            else:
                b = prev["body"]
                lines.append(orjson.dumps({"id": f"native-{k}", "prompt": b["prompt"], "sampling": {"max_tokens": b["max_tokens"], "temperature": 0.0}}))
                twins[f"native-{k}"] = prev["custom_id"]
        else:
            lines.append(orjson.dumps(request(f"req-{k}", i, rng)))
            i += 1
    path.write_bytes(b"\n".join(lines) + b"\n")
    return lines, twins


def env_for(s) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("QWORKER_")}
    env.update({f"QWORKER_{f.upper()}": str(getattr(s, f)) for f in ("bootstrap_servers", "group_id", "jobs_topic", "tokens_topic", "completions_topic",
                                                                         "dlq_topic", "cancel_topic", "session_timeout_ms", "heartbeat_interval_ms",
                                                                         "fetch_max_wait_ms", "commit_interval_ms", "linger_ms")})
    return env


def cli(*args: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qworker.cli", *args], env=env, cwd=REPO, capture_output=True, timeout=timeout)


async def test_thousand_line_file_round_trips(broker, tmp_path) -> None:
    s = make_settings(broker.bootstrap, session_timeout_ms=3000)
    await create_topics(s, partitions=4)
    env = env_for(s)
    batch, out = tmp_path / "batch.jsonl", tmp_path / "results.jsonl"
    lines, twins = build(batch)
    wenv = {**env, "QWORKER_MODEL": str(model_dir()), "QWORKER_HTTP_PORT": "-1", "QWORKER_LOG_FORMAT": "text", "QWORKER_MAX_WAITING_JOBS": "128",
            "QWORKER_ADMISSION_RESERVE_TOKENS": "4", "QWORKER_MAX_NUM_SEQS": "128", "QWORKER_KV_CACHE_MEMORY": "64MiB", "QWORKER_DRAIN_TIMEOUT_S": "10"}
    log = tmp_path / "worker.log"
    with open(log, "wb") as f:
        worker = subprocess.Popen([sys.executable, "-m", "qworker.cli", "run"], env=wenv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        sub = cli("submit", "--file", str(batch), env=env, timeout=120)
        assert sub.returncode == 0, sub.stderr.decode()[-3000:]
        err = sub.stderr.decode()
        assert "submitted 960 of 1000 lines" in err and "40 not submitted" in err, err[-2000:]
        assert "refused an idempotent producer" in err  # the fallback, said once
        col = cli("collect", "--ids-from", str(batch), "--out", str(out), "--timeout-s", "200", env=env, timeout=260)
        elapsed = time.monotonic() - t0
        assert col.returncode == 1, (col.returncode, col.stderr.decode()[-3000:], log.read_text()[-3000:])  # some lines are errors
        assert "collected 1000 lines" in col.stderr.decode()
        assert "refused an idempotent producer" in log.read_text()
        assert worker.poll() is None, log.read_text()[-3000:]
    finally:
        worker.terminate()
        worker.wait(60)
    results = [orjson.loads(x) for x in out.read_bytes().splitlines()]
    inputs = read_lines(batch.read_bytes())
    assert len(results) == len(inputs) == 1000
    by_id = {}
    for ln, res in zip(inputs, results):
        validate_line(res)
        assert res["custom_id"] == ln.answer_id
        by_id[res["custom_id"]] = res
        status = res["response"]["status_code"]
        if ln.key is None:
            want = next(why for raw, why in INVALID if raw == ln.raw)
            assert status == 400 and want in res["error"]["message"] and f"line {ln.number}" in res["error"]["message"]
        elif ln.key.startswith("bad-"):
            assert status == 400 and res["error"]["code"] in ("invalid_job", "unsupported_parameter"), res
        else:
            assert status == 200, res
            body = res["response"]["body"]
            if ln.fmt == "openai":
                want_n = ln.data["body"].get("max_tokens") or ln.data["body"].get("max_completion_tokens")
                assert 1 <= body["usage"]["completion_tokens"] <= want_n
                if "logprobs" in ln.data["body"]:
                    assert body["choices"][0]["logprobs"] is not None
    assert results[3]["custom_id"] == "line-4"  # not JSON: named by its line number
    assert results[53]["custom_id"] == "line-54"  # no id at all
    assert results[78]["custom_id"] == "x" * 300  # a string custom_id, even an unusable one, is kept
    # greedy: an OpenAI line and the native job asking the same thing get the same text
    assert len(twins) >= 10
    for nid, cid in twins.items():
        assert by_id[nid]["response"]["body"]["choices"][0]["text"] == by_id[cid]["response"]["body"]["choices"][0]["text"], (nid, cid)
    print(f"round trip of 1000 lines: {elapsed:.1f} s")
