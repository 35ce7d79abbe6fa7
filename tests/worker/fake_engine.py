"""A stand-in for ``qworker.engine.AsyncEngine`` with the same contract, for tests that exercise
the Kafka side without loading the model. One character is one token; the "model" emits a
deterministic letter sequence, one token per step per request, all requests batched together."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from qworker.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from qworker.engine.sampling_params import InvalidRequestError, SamplingParams


@dataclass
class Capacity:
    free_tokens: int
    num_running: int
    num_waiting: int
    block_size: int
    total_tokens: int


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: list[list[int]] = field(default_factory=list)
    running: bool = False
    metrics: RequestMetrics | None = None


def expected_text(prompt_ids: list[int], max_tokens: int) -> str:
    s = sum(prompt_ids)
    return "".join(chr(ord("a") + (s + i) % 26) for i in range(max_tokens))


class FakeEngine:
    model_name = "fake-model"

    def __init__(self, step_s: float = 0.002, total_tokens: int = 100_000, max_model_len: int = 2048, max_num_seqs: int = 64):
        self.step_s, self.total_tokens, self.max_model_len, self.max_num_seqs = step_s, total_tokens, max_model_len, max_num_seqs
        self.reqs: dict[str, _Req] = {}
        self.ready = False
        self.last_step_time = time.monotonic()
        self.max_running_seen = 0
        self.started_ids: list[str] = []
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    tokenizer = None

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop())
        self.ready = True

    async def shutdown(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def encode(self, prompt: str | list[int] | list[dict]) -> list[int]:
        if isinstance(prompt, str):
            ids = [ord(c) for c in prompt]
        elif prompt and isinstance(prompt[0], dict):
            ids = [ord(c) for c in "".join(f"<{m['role']}>{m['content']}" for m in prompt)]  # type: ignore[index]
        else:
            ids = list(prompt)  # type: ignore[arg-type]
            if any(t >= 0x110000 for t in ids):
                raise InvalidRequestError("invalid_prompt", "token id out of vocabulary")
        if not ids:
            raise InvalidRequestError("invalid_prompt", "empty prompt")
        return ids

    def check(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) + 1 > self.max_model_len:
            raise InvalidRequestError("prompt_too_long", f"prompt has {len(ids)} tokens, max_model_len {self.max_model_len}")

    def _used(self) -> int:
        return sum(len(r.prompt) + sum(len(g) for g in r.generated) for r in self.reqs.values())

    def capacity(self) -> Capacity:
        running = sum(1 for r in self.reqs.values() if r.running)
        return Capacity(self.total_tokens - self._used(), running, len(self.reqs) - running, 16, self.total_tokens)

    async def abort(self, rid: str) -> None:
        r = self.reqs.pop(rid, None)
        if r is not None:
            r.queue.put_nowait("abort")

    async def generate(self, rid: str, prompt: list[int], params: SamplingParams, priority: int = 0) -> AsyncIterator[RequestOutput]:
        if rid in self.reqs:
            raise ValueError(f"duplicate request id {rid}")
        r = _Req(rid, list(prompt), params, priority, generated=[[] for _ in range(params.n)], metrics=RequestMetrics(arrival_time=time.time()))
        self.reqs[rid] = r
        self.started_ids.append(rid)
        assert self._wake is not None
        self._wake.set()
        try:
            while True:
                item = await r.queue.get()
                if item == "abort":
                    yield RequestOutput(rid, None, r.prompt, [CompletionOutput(i, "", [], "abort") for i in range(params.n)], True, metrics=r.metrics)
                    return
                yield item
                if item.finished:
                    return
        finally:
            self.reqs.pop(rid, None)

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            if not self.reqs:
                self._wake.clear()
                await self._wake.wait()
            await asyncio.sleep(self.step_s)
            self.last_step_time = time.monotonic()
            order = sorted(self.reqs.values(), key=lambda r: r.priority)
            for r in order[: self.max_num_seqs]:
                if not r.running:
                    r.running = True
                    r.metrics.first_scheduled_time = time.time()
            self.max_running_seen = max(self.max_running_seen, sum(r.running for r in self.reqs.values()))
            for r in [r for r in order if r.running]:
                outs = []
                s = sum(r.prompt)
                for i, g in enumerate(r.generated):
                    tok = ord("a") + (s + len(g) + i) % 26
                    g.append(tok)
                    fin = "length" if len(g) >= r.params.max_tokens else None
                    outs.append(CompletionOutput(i, chr(tok), [tok], fin))
                if r.metrics.first_token_time is None:
                    r.metrics.first_token_time = time.time()
                done = all(o.finish_reason for o in outs)
                if done:
                    r.metrics.finished_time = time.time()
                    self.reqs.pop(r.rid, None)
                r.queue.put_nowait(RequestOutput(r.rid, None, r.prompt, outs, done, metrics=r.metrics))
