"""Per-job LoRA adapters through the worker, end to end: the real broker, the real engine with
LoRA on, two real random PEFT adapters (made with ``peft``), hostile ones beside them.

The model is the tiny 2-layer random-weight Llama with the real tokenizer (``tiny_model_dir``):
what is checked here is the worker's plumbing (names, refusals, reloads, errors, metrics, spans)
and that each job ran under its adapter, which the engine's own output per adapter shows; the
engine's parity with PEFT on the real model is tests/engine/test_lora_engine.py's.

One worker start for the module (one test): native jobs naming each adapter and the base,
OpenAI lines naming an adapter / the base / nothing served, jobs naming unknown and refused
adapters; then an adapter added by rewriting the modules file while the worker runs. Every job
is answered and committed; greedy outputs under an adapter differ from the base model's and
equal the engine's own output for that adapter (a direct ``generate`` with a ``LoRARequest``
the test makes itself), and the base jobs equal the engine's base output.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import time

import orjson
import pytest

from qworker.worker import Worker
from qworker.worker.client import ResultReader, create_topics, submit

from .conftest import KV_BYTES, engine_available, make_settings, model_dir, wait_committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = "The capital of France is"
MAX_TOKENS = 6
MAX_RANK = 8


def lora_engine_available() -> bool:
    if not engine_available():
        return False
    from qworker.engine import AsyncEngine

    return "lora_request" in inspect.signature(AsyncEngine.generate).parameters


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    """root/{a, b, big, nan} (big: rank above the worker's limit, nan: a NaN weight), root/link ->
    a folder outside the root, root/missing (no folder); returns (root, paths by name)."""
    from tests.engine.lora_support import ALL_MODULES, edit_adapter_config, make_peft_adapter

    base = tmp_path_factory.mktemp("lora")
    root, outside = base / "root", base / "outside"
    root.mkdir()
    paths = {
        "a": make_peft_adapter(tiny_model_dir, root / "a", rank=4, target_modules=ALL_MODULES, seed=1, b_std=1.0),
        "b": make_peft_adapter(tiny_model_dir, root / "b", rank=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], seed=2, b_std=1.0),
    }
    shutil.copytree(root / "a", root / "big")
    edit_adapter_config(root / "big", r=MAX_RANK * 2)  # refused on its config, before any tensor is read
    paths["big"] = root / "big"
    shutil.copytree(root / "a", root / "nan")  # a's tensors with one NaN
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(root / "nan" / "adapter_model.safetensors"))
    first = sorted(tensors)[0]
    tensors[first].view(-1)[0] = float("nan")
    save_file(tensors, str(root / "nan" / "adapter_model.safetensors"))
    paths["nan"] = root / "nan"
    shutil.copytree(root / "a", outside / "a")  # a valid adapter, but outside the root
    os.symlink(outside / "a", root / "link")
    paths["link"] = root / "link"
    paths["missing"] = root / "missing"
    return root, {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir):
    if not lora_engine_available():
        pytest.skip("the engine does not take lora_request yet")
    from qworker.engine import LLM, AsyncEngine

    # one slot for two adapters: the scheduler must take turns
    llm = LLM(str(tiny_model_dir), kv_cache_memory=KV_BYTES, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=MAX_RANK)
    eng = AsyncEngine(llm.engine)
    asyncio.run(eng.start())
    yield eng
    asyncio.run(eng.shutdown())


async def direct(eng, prompt: str, lora) -> list[int]:
    """The engine's own greedy tokens for ``prompt`` under ``lora`` (no worker involved)."""
    from qworker.engine import SamplingParams

    ids: list[int] = []
    kw = {} if lora is None else {"lora_request": lora}
    async for out in eng.generate(f"direct-{time.monotonic_ns()}", eng.encode(PROMPT if prompt is None else prompt),
                                  SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), **kw):
        ids.extend(out.outputs[0].token_ids)
    return ids


def native(jid: str, **kw) -> dict:
    return {"id": jid, "prompt": PROMPT, "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0}, **kw}


def line(cid: str, **body) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **body}}


class Answers:
    def __init__(self, s):
        self.reader = ResultReader(s, [s.completions_topic])
        self.by_key: dict[str, dict] = {}

    async def __aenter__(self):
        await self.reader.start()
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        async for rec in self.reader.records():
            self.by_key.setdefault(rec.key.decode(), orjson.loads(rec.value))

    async def wait(self, keys: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not keys <= self.by_key.keys():
            assert time.monotonic() < deadline, f"unanswered: {sorted(keys - self.by_key.keys())}"
            await asyncio.sleep(0.05)

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self.reader.stop()


async def test_jobs_pick_adapters_by_name(lora_engine, adapters, broker, tmp_path) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from qworker.engine import LoRARequest
    from qworker.telemetry.tracing import from_provider

    eng = lora_engine
    root, paths = adapters
    modules = tmp_path / "modules.json"
    modules.write_text(json.dumps({n: paths[n] for n in ("a", "b", "big", "nan", "link", "missing")}))
    s = make_settings(broker.bootstrap, lora_modules=str(modules), lora_root=str(root), lora_reload_interval_s=0.2)
    await create_topics(s, partitions=4)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = from_provider(provider)
    base_name = eng.model_name
    w = Worker(s, eng, tracing=tracing)
    await w.start()
    try:
        # the hostile adapters are refused with their reasons; the worker is up and serves the rest
        assert sorted(w.adapters.served) == ["a", "b"]
        assert sorted(w.adapters.refused) == ["big", "link", "missing", "nan"]
        assert "NaN" in w.adapters.refused["nan"]
        assert "rank" in w.adapters.refused["big"] and "outside" in w.adapters.refused["link"] and "does not exist" in w.adapters.refused["missing"]
        jobs = [
            native("n-base"), native("n-a", lora="a"), native("n-b", lora="b"), native("n-a-by-model", model="a"),
            native("n-unknown", lora="nope"), native("n-big", lora="big"), native("n-link", lora="link"),
            line("o-b", model="b"), line("o-base", model=base_name), line("o-unknown", model="nope"),
        ]
        async with Answers(s) as got:
            await submit(s, jobs)
            await got.wait({j.get("id") or j.get("custom_id") for j in jobs}, 150)
            out = dict(got.by_key)

            # an adapter added to the running worker: a new name for a's folder (so a new id)
            modules.write_text(json.dumps({"a": paths["a"], "b": paths["b"], "a-again": paths["a"]}))
            deadline = time.monotonic() + 20
            while "a-again" not in w.adapters.served:
                assert time.monotonic() < deadline, "the modules file was not re-read"
                await asyncio.sleep(0.1)
            assert w.adapters.served["a-again"].lora_int_id not in (w.adapters.served["a"].lora_int_id, w.adapters.served["b"].lora_int_id)
            assert "big" not in w.adapters.served and "big" not in w.adapters.refused  # removed from the file
            await submit(s, [native("n-a-again", lora="a-again"), native("n-big-gone", lora="big")])
            # and one from the CLI's flags
            from typer.testing import CliRunner

            from qworker.cli import app

            cli = await asyncio.to_thread(CliRunner().invoke, app, ["submit", "-p", PROMPT, "--lora", "b", "--id", "cli-b", "--max-tokens", str(MAX_TOKENS),
                                                                     "--no-stream", "--bootstrap-servers", s.bootstrap_servers],
                                          env={"QWORKER_JOBS_TOPIC": s.jobs_topic, "QWORKER_ENABLE_IDEMPOTENCE": "false"})
            assert cli.exit_code == 0, cli.output
            await got.wait({"n-a-again", "n-big-gone", "cli-b"}, 60)
            out.update(got.by_key)
        await wait_committed(s)

        # errors: model_not_found for that job only, natively and in OpenAI's shape
        for jid, says in (("n-unknown", "'nope'"), ("n-big", "rank"), ("n-link", "outside"), ("n-big-gone", "'big'")):
            assert out[jid]["type"] == "error" and out[jid]["error"]["code"] == "model_not_found", out[jid]
            assert says in out[jid]["error"]["message"] and out[jid]["error"]["retryable"] is False
        err = out["o-unknown"]
        assert (err["response"]["status_code"], err["error"]["code"]) == (404, "model_not_found")
        assert err["response"]["body"]["error"]["code"] == "model_not_found"

        # answers: the base and each adapter, named as asked
        tokens = {k: out[k]["choices"][0]["token_ids"] for k in ("n-base", "n-a", "n-b", "n-a-by-model", "n-a-again")}
        assert {k: out[k]["model"] for k in tokens} == {"n-base": w.model_name, "n-a": "a", "n-b": "b", "n-a-by-model": "a", "n-a-again": "a-again"}
        assert out["o-b"]["response"]["status_code"] == 200 and out["o-b"]["response"]["body"]["model"] == "b"
        assert out["o-base"]["response"]["body"]["model"] == w.model_name
        assert out["o-base"]["response"]["body"]["choices"][0]["text"] == out["n-base"]["choices"][0]["text"]
        assert out["o-b"]["response"]["body"]["choices"][0]["text"] == out["n-b"]["choices"][0]["text"]

        # outputs really move under an adapter, and equal the engine's own run for it
        assert tokens["n-a"] != tokens["n-base"] and tokens["n-b"] != tokens["n-base"] and tokens["n-a"] != tokens["n-b"]
        assert tokens["n-a-by-model"] == tokens["n-a-again"] == tokens["n-a"]
        assert out["cli-b"]["model"] == "b" and out["cli-b"]["choices"][0]["token_ids"] == tokens["n-b"]
        assert tokens["n-base"] == await direct(eng, PROMPT, None)
        assert tokens["n-a"] == await direct(eng, PROMPT, LoRARequest("ref-a", 1001, paths["a"]))
        assert tokens["n-b"] == await direct(eng, PROMPT, LoRARequest("ref-b", 1002, paths["b"]))

        # metrics: per adapter, vLLM's info gauge, refusals
        w.gauges.observe()
        body = w.metrics.render()[0].decode()
        assert 'qworker:lora_requests_total{lora_name="a",model_name="%s",outcome="completed"} 2.0' % w.model_name in body
        assert 'qworker:lora_requests_total{lora_name="b",model_name="%s",outcome="completed"} 3.0' % w.model_name in body
        assert 'qworker:lora_adapter_refusals_total{lora_name="link",model_name="%s"} 1.0' % w.model_name in body
        assert 'qworker:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}' in body
        assert 'code="model_not_found"' in body

        # traces: the adapter's name on its job's spans
        spans = exporter.get_finished_spans()
        gen = [sp for sp in spans if sp.name == "generate" and sp.attributes.get("qworker.lora.name") == "b"]
        assert len(gen) == 3 and all(sp.attributes["gen_ai.request.model"] == "b" for sp in gen)
        assert any(sp.name.startswith("process ") and sp.attributes.get("qworker.lora.name") == "a" for sp in spans)
    finally:
        await w.stop()
        tracing.shutdown()
