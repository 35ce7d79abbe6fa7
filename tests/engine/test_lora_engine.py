"""LoRA through the whole engine (``LLM`` / ``LLMEngine`` / ``AsyncEngine``) on the real test model.

Random PEFT adapters (B non-zero) against HF PEFT's greedy outputs, with three adapters and base
requests mixed in one ``generate`` call over two device slots; every forward of the module is
watched (``runner.execute`` wrapped) so no step ever holds more adapters than ``max_loras``. One
engine for the module: a small KV pool (so long requests preempt) and n-gram speculation on (so
verify chunks run under adapters too).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from qworker import LLM, InvalidRequestError, LoRARequest, SamplingParams
from qworker.engine.structured.spec import StructuredOutputsParams
from qworker.model.lora.adapter import LoRAAdapterError
from qworker.engine.async_engine import AsyncEngine
from tests.engine.lora_support import ALL_MODULES, assert_peft_greedy, make_peft_adapter

MAX_LORAS = 2
KV_BLOCKS = 14  # 16-token blocks: five 52-token requests at once do not fit, so some preempt
PROMPTS = [
    [1, 504, 3458, 314, 2114, 282, 4649, 30, 378, 13],
    [1, 22, 333, 4444, 55, 6, 22, 333, 4444, 55],
    [1, 1205, 2771, 28, 253, 4767, 6724, 327, 253],
]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("engine-loras")
    paths = {
        "all8": make_peft_adapter(model_dir, root / "all8", rank=8, alpha=16, seed=11, target_modules=ALL_MODULES),
        "qvd4": make_peft_adapter(model_dir, root / "qvd4", rank=4, alpha=8, seed=12, use_rslora=True,
                                  target_modules=["q_proj", "v_proj", "down_proj"]),
        "mlp16": make_peft_adapter(model_dir, root / "mlp16", rank=16, alpha=32, seed=13, target_modules=["o_proj", "gate_proj", "up_proj"]),
    }
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(paths.items())}


@pytest.fixture(scope="module")
def llm(model_dir):
    block_bytes = 30 * 2 * 16 * 3 * 64 * 4  # layers * (k, v) * block * kv heads * head dim * fp32
    llm = LLM(str(model_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=16,
              max_cpu_loras=3, kv_cache_memory=KV_BLOCKS * block_bytes,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert llm.engine.kv.pool.num_blocks == KV_BLOCKS
    runner = llm.engine.runner
    execute = runner.execute
    llm.steps_seen = []  # per forward: the distinct slots its chunks use, and the adapter in each
    llm.lora_verify_chunks = 0  # speculative verify chunks that ran under an adapter

    def watched(batch):
        slots = {c.lora_slot for c in batch.chunks if c.lora_slot >= 0}
        llm.steps_seen.append({s: llm.engine.loras.slot_ids[s] for s in slots})
        llm.lora_verify_chunks += sum(1 for c in batch.chunks if c.num_draft and c.lora_slot >= 0)
        return execute(batch)

    runner.execute = watched
    return llm


def check_parity(model_dir, outs, loras, what):
    """Every output is PEFT's greedy continuation under its adapter (teacher-forced: one PEFT
    forward per output, see ``assert_peft_greedy``)."""
    for i, (out, lora) in enumerate(zip(outs, loras)):
        for choice in out.outputs:
            assert len(choice.token_ids) == out_len(out)
            assert_peft_greedy(model_dir, None if lora is None else lora.lora_path, out.prompt_token_ids, choice.token_ids,
                               f"{what} #{i}.{choice.index} ({lora.lora_name if lora else 'base'})")


def out_len(out) -> int:
    return len(out.outputs[0].token_ids)


def test_mixed_adapters_and_base_match_peft_with_fewer_slots_than_adapters(llm, adapters, model_dir):
    a, b, c = adapters.values()
    loras = [a, b, c, None, b, a]
    prompts = [PROMPTS[i % 3] for i in range(len(loras))]
    writes = llm.engine.loras.counters["lora_slot_writes"]
    outs = llm.generate(prompts, greedy(10), lora_request=loras, use_tqdm=False)
    assert [o.lora_request for o in outs] == loras
    check_parity(model_dir, outs, loras, "mixed")
    # three adapters went through two slots: some slot was rewritten, no step held more than two
    assert llm.engine.loras.counters["lora_slot_writes"] - writes >= 3
    assert llm.steps_seen and max(len(s) for s in llm.steps_seen) <= MAX_LORAS
    assert any(len(s) == MAX_LORAS for s in llm.steps_seen), "adapters shared steps"
    # the adapters really move the outputs: a vs the base model on one prompt, c vs a on another
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids != outs[5].outputs[0].token_ids


def test_one_lora_request_for_every_prompt_and_chat(llm, adapters, model_dir):
    b = adapters["qvd4"]
    outs = llm.generate([PROMPTS[1], PROMPTS[1]], greedy(6), lora_request=b, use_tqdm=False)
    check_parity(model_dir, outs, [b, b], "one for all")
    chat = llm.chat([{"role": "user", "content": "Name a colour."}], greedy(6), lora_request=b, use_tqdm=False)
    check_parity(model_dir, chat, [b], "chat")


def test_prefix_cache_never_crosses_adapters(llm, adapters, model_dir):
    a, b = adapters["all8"], adapters["mlp16"]
    prompt = list(range(1000, 1034))  # two full blocks before the last token
    first = {}
    for name, lora in (("a", a), ("b", b), ("base", None)):
        (out,) = llm.generate([prompt], greedy(3), lora_request=lora, use_tqdm=False)
        assert out.num_cached_tokens == 0, f"{name}: hit blocks computed under another adapter"
        first[name] = out.outputs[0].token_ids
    for name, lora in (("a", a), ("b", b), ("base", None)):
        (out,) = llm.generate([prompt], greedy(3), lora_request=lora, use_tqdm=False)
        assert out.num_cached_tokens == 32, f"{name}: its own blocks are hits"
        assert out.outputs[0].token_ids == first[name]
    assert len({tuple(v) for v in first.values()}) == 3


def test_preemption_and_forks_keep_each_request_on_its_adapter(llm, adapters, model_dir):
    a, b, c = adapters.values()
    engine = llm.engine
    before = engine.stats()
    long_prompts = [[1] + [(7 * i + 13 * j) % 5000 + 100 for j in range(39)] for i in range(5)]
    loras = [a, b, None, a, b]
    outs = llm.generate(long_prompts, greedy(12), lora_request=loras, use_tqdm=False)
    after = engine.stats()
    assert after["preemptions_swap"] + after["preemptions_recompute"] > before["preemptions_swap"] + before["preemptions_recompute"]
    preempted = [i for i, o in enumerate(outs) if o.metrics.num_preemptions]
    assert preempted
    # run alone (no pressure, no preemption) a preempted request gives the same tokens: it came
    # back under its own adapter
    for i in preempted[:2]:
        (alone,) = llm.generate([long_prompts[i]], greedy(12), lora_request=loras[i], use_tqdm=False)
        assert alone.metrics.num_preemptions == 0
        assert alone.outputs[0].token_ids == outs[i].outputs[0].token_ids, f"request {i}"
    # n > 1: every greedy choice of a forked request runs under the request's adapter
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True), lora_request=c, use_tqdm=False)
    assert len(out.outputs) == 2 and out.outputs[0].token_ids == out.outputs[1].token_ids
    check_parity(model_dir, [out], [c], "fork")
    assert max(len(s) for s in llm.steps_seen) <= MAX_LORAS


def test_structured_output_under_an_adapter(llm, adapters):
    spec = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec),
                        lora_request=[adapters["mlp16"], None], use_tqdm=False)
    assert [o.outputs[0].text in ("alpha", "beta", "gamma") for o in outs] == [True, True]


def test_every_slot_served_the_adapter_of_its_step(llm, adapters):
    # the watched forwards: a chunk's slot always held an adapter (never a cleared slot)
    assert all(None not in s.values() for s in llm.steps_seen)
    assert llm.list_loras() <= {lr.lora_int_id for lr in adapters.values()}
    # speculation ran under adapters too (its verify chunks carry the request's slot; the
    # parity checks above cover their outputs)
    assert llm.lora_verify_chunks > 0


def test_bad_lora_requests_are_refused_before_anything_runs(llm, adapters, tmp_path):
    engine = llm.engine
    finished = engine.counters["requests_finished"]
    a = adapters["all8"]
    with pytest.raises(InvalidRequestError, match="could not be loaded") as e:
        llm.generate(PROMPTS[:2], greedy(3), lora_request=[a, LoRARequest("gone", 77, str(tmp_path / "missing"))], use_tqdm=False)
    assert e.value.code == "invalid_lora" and isinstance(e.value, LoRAAdapterError)  # the loader's type too
    bad = tmp_path / "too-big"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 64, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    (bad / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(InvalidRequestError, match="could not be loaded"):
        llm.generate(PROMPTS[:1], greedy(3), lora_request=LoRARequest("big", 78, str(bad)), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="already names"):
        llm.generate(PROMPTS[:1], greedy(3), lora_request=LoRARequest("clash", a.lora_int_id, str(bad)), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="own id"):
        llm.generate(PROMPTS[:2], greedy(3), lora_request=[LoRARequest("p", 60, a.lora_path), LoRARequest("q", 60, str(bad))], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="LoRARequest"):
        llm.generate(PROMPTS[:1], greedy(3), lora_request="all8", use_tqdm=False)
    assert engine.counters["requests_finished"] == finished and not engine.requests


def test_lora_request_without_enable_lora_is_refused(tiny_model_dir):
    plain = LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_memory=1 << 20)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        plain.generate([[1, 2, 3]], greedy(2), lora_request=LoRARequest("x", 1, "/nowhere"), use_tqdm=False)


def test_async_engine_fails_only_the_request_whose_adapter_cannot_load(llm, adapters, model_dir, tmp_path):
    """Last in the module: the module's engine is driven by an AsyncEngine here (and stays usable)."""
    a = adapters["all8"]
    engine = llm.engine
    engine.remove_lora(a.lora_int_id)  # so the good request's adapter loads in the background too
    assert a.lora_int_id not in llm.list_loras()
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    (broken / "adapter_model.safetensors").write_bytes(b"")
    jobs = [("good", PROMPTS[0], a), ("broken", PROMPTS[1], LoRARequest("broken", 90, str(broken))),
            ("base", PROMPTS[2], None), ("missing", PROMPTS[0], LoRARequest("missing", 91, str(tmp_path / "nope")))]

    async def run():
        ae = AsyncEngine(engine)
        await ae.start()
        try:
            async def one(rid, prompt, lora):
                last, tokens = None, []
                async for out in ae.generate(rid, prompt, greedy(6), lora_request=lora):
                    last = out
                    for c in out.outputs:
                        tokens += c.token_ids
                return last, tokens

            results = await asyncio.gather(*(one(*j) for j in jobs))
            stats = ae.lora_stats()
            added = await ae.add_lora(adapters["qvd4"])
            with pytest.raises(InvalidRequestError):
                await ae.add_lora(LoRARequest("missing2", 92, str(tmp_path / "nope")))
            return results, stats, added, await ae.list_loras()
        finally:
            await ae.shutdown()

    results, stats, added, loaded = asyncio.run(run())
    by_id = {rid: r for (rid, _, _), r in zip(jobs, results)}
    for rid in ("broken", "missing"):
        last, tokens = by_id[rid]
        assert last.finished and last.error_code == "invalid_lora" and not tokens
        assert last.outputs[0].finish_reason == "abort"
        assert rid in last.error
    assert_peft_greedy(model_dir, a.lora_path, PROMPTS[0], by_id["good"][1], "good")
    assert_peft_greedy(model_dir, None, PROMPTS[2], by_id["base"][1], "base")
    assert len(by_id["good"][1]) == len(by_id["base"][1]) == 6
    assert stats == {"running": {}, "waiting": {}, "max_lora": MAX_LORAS}
    assert added and adapters["qvd4"].lora_int_id in loaded
    assert not engine.requests
