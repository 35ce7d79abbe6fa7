"""Regression tests from an adversarial review of the OpenAI batch support (issue 15)."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from aiokafka import AIOKafkaProducer

from qworker.openai_batch.files import read_lines
from qworker.openai_batch.requests import OpenAIRequest
from qworker.openai_batch.results import IdText, output_line, run_headers
from qworker.openai_batch.transfer import collect_lines
from qworker.worker.client import create_topics

from .conftest import make_settings
from .openai_support import validate_line
from .test_openai_cli import completion

pytestmark = pytest.mark.timeout(90)


async def test_collect_finishes_on_a_busy_completions_topic(broker) -> None:
    """Every id answered: collect must stop once it has read what was on the topic then, even
    while other jobs' answers keep arriving (a shared topic is never idle)."""
    s = make_settings(broker.bootstrap)
    await create_topics(s, partitions=2)
    p = AIOKafkaProducer(bootstrap_servers=s.bootstrap_servers, enable_idempotence=False, linger_ms=0)
    await p.start()
    stop = asyncio.Event()

    async def chatter() -> None:  # other clients' results, on and on
        i = 0
        while not stop.is_set():
            await p.send_and_wait(s.completions_topic, b"{}", key=f"other-{i}".encode())
            i += 1
            await asyncio.sleep(0.02)

    try:
        msg = completion("a", 0, "hi")
        ctx = OpenAIRequest("a", "chat")
        await p.send_and_wait(s.completions_topic, orjson.dumps(output_line(msg, ctx, IdText())), key=b"a", headers=run_headers(0, msg.run_id))
        task = asyncio.create_task(chatter())
        await asyncio.sleep(0.3)
        lines = read_lines(orjson.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "q"}]}}))
        t0 = time.monotonic()
        rep, [line] = await collect_lines(s, lines, None, timeout_s=12.0)
        took = time.monotonic() - t0
        stop.set()
        await task
    finally:
        stop.set()
        await p.stop()
    assert not rep.timed_out and rep.ok == 1
    validate_line(line)
    assert took < 6.0, f"collect took {took:.1f} s with every id answered"


async def test_submit_follow_prints_the_answer_on_a_busy_tokens_topic(broker, capsys) -> None:
    """--follow holds an answer until the stream's tail is read; on a tokens topic other jobs
    keep writing to, it must still print it (it printed nothing until its timeout)."""
    from qworker.cli import _follow
    from qworker.messages import Delta, dumps
    from qworker.worker.client import ResultReader

    s = make_settings(broker.bootstrap)
    await create_topics(s, partitions=2)
    reader = ResultReader(s, [s.tokens_topic, s.completions_topic], from_beginning=True)
    await reader.start()
    p = AIOKafkaProducer(bootstrap_servers=s.bootstrap_servers, enable_idempotence=False, linger_ms=0)
    await p.start()
    stop = asyncio.Event()

    async def chatter() -> None:
        i = 0
        while not stop.is_set():
            await p.send_and_wait(s.tokens_topic, b"{}", key=f"other-{i}".encode())
            i += 1
            await asyncio.sleep(0.02)

    task = asyncio.create_task(chatter())
    try:
        await p.send_and_wait(s.tokens_topic, dumps(Delta(job_id="x", attempt=0, run_id="r", index=0, seq=0, text="hello", token_ids=[1])), key=b"x")
        await p.send_and_wait(s.completions_topic, dumps(completion("x", 0, "hello")), key=b"x")
        t0 = time.monotonic()
        await _follow(reader, ["x"], 10.0)
        took = time.monotonic() - t0
    finally:
        stop.set()
        await task
        await p.stop()
        await reader.stop()
    out = capsys.readouterr().out
    assert out.startswith("hello") and '"job_id":"x"' in out, out
    assert took < 5.0, f"--follow took {took:.1f} s"
