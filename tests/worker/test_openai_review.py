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
