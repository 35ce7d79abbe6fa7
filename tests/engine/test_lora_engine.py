"""LoRA through the whole engine (``LLM`` / ``LLMEngine`` / ``AsyncEngine``).

On the real test model, one ``generate`` call mixes three random PEFT adapters (B non-zero) and
base requests over two device slots (``max_loras`` < adapters), with n-gram speculation on (so
verify chunks run under adapters too): every output is HF PEFT's greedy continuation, and the
adapters really move the outputs.

Every other check is about the engine's mechanics and runs on the tiny random-weight Llama
(``tiny_model_dir``), its outputs checked against PEFT on that same model: preemption (a small KV
pool), forks (n > 1), one ``LoRARequest`` for every prompt and chat, the prefix cache never
crossing adapters, structured output, refusals, and the ``AsyncEngine``. Both engines' forwards
are watched (``runner.execute`` wrapped): no step ever holds more adapters than ``max_loras``, and
a chunk's slot always holds an adapter.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from qworker import LLM, InvalidRequestError, LoRARequest, SamplingParams
from qworker.engine.structured.spec import StructuredOutputsParams
from qworker.model.lora.adapter import LoRAAdapterError
from qworker.engine.async_engine import AsyncEngine
from tests.engine.lora_support import ALL_MODULES, assert_peft_greedy_many, make_peft_adapter

MAX_LORAS = 2
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
TINY_BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # layers * (k, v) * block * kv heads * head dim * fp32
TINY_KV_BLOCKS = 14  # 16-token blocks: five 52-token requests at once do not fit, so some preempt
PROMPTS = [
    [1, 504, 3458, 314, 2114, 282, 4649, 30, 378, 13],
    [1, 22, 333, 4444, 55, 6, 22, 333, 4444, 55],
    [1, 1205, 2771, 28, 253, 4767, 6724, 327, 253],
]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def make_adapters(base_dir, root, b_std: float = 0.15) -> dict[str, LoRARequest]:
    """Three adapters of different ranks, targets and scalings (one rsLoRA), ids 1..3."""
    kw = {"b_std": b_std}
    paths = {
        "all8": make_peft_adapter(base_dir, root / "all8", rank=8, alpha=16, seed=11, target_modules=ALL_MODULES, **kw),
        "qvd4": make_peft_adapter(base_dir, root / "qvd4", rank=4, alpha=8, seed=12, use_rslora=True,
                                  target_modules=["q_proj", "v_proj", "down_proj"], **kw),
        "mlp16": make_peft_adapter(base_dir, root / "mlp16", rank=16, alpha=32, seed=13, target_modules=["o_proj", "gate_proj", "up_proj"],
                                   **kw),
    }
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(paths.items())}


def watched_llm(model_dir, **kw) -> LLM:
    """An LLM whose forwards are recorded: ``steps_seen`` (per forward, the adapter in each slot
    its chunks use) and ``lora_verify_chunks`` (speculative verify chunks run under an adapter)."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=16,
              max_cpu_loras=3, speculative_config=NGRAM, **kw)
    runner = llm.engine.runner
    execute = runner.execute
    llm.steps_seen = []
    llm.lora_verify_chunks = 0

    def watched(batch):
        slots = {c.lora_slot for c in batch.chunks if c.lora_slot >= 0}
        llm.steps_seen.append({s: llm.engine.loras.slot_ids[s] for s in slots})
        llm.lora_verify_chunks += sum(1 for c in batch.chunks if c.num_draft and c.lora_slot >= 0)
        return execute(batch)

    runner.execute = watched
    return llm


def assert_steps_kept_the_limit(llm: LLM) -> None:
    assert llm.steps_seen and max(len(s) for s in llm.steps_seen) <= MAX_LORAS
    # a chunk's slot always held an adapter (never a cleared slot)
    assert all(None not in s.values() for s in llm.steps_seen)


def check_parity(model_dir, outs, loras, what) -> None:
    """Every choice of every output is PEFT's greedy continuation under its adapter, all
    teacher-forced in one mixed-adapter forward (``assert_peft_greedy_many``)."""
    cases = []
    for i, (out, lora) in enumerate(zip(outs, loras)):
        for choice in out.outputs:
            assert len(choice.token_ids) == len(out.outputs[0].token_ids)
            cases.append((None if lora is None else lora.lora_path, out.prompt_token_ids, choice.token_ids,
                          f"{what} #{i}.{choice.index} ({lora.lora_name if lora else 'base'})"))
    assert_peft_greedy_many(model_dir, cases)


# -- the real model: the numbers ----------------------------------------------------------------

def test_mixed_adapters_and_base_match_peft_with_fewer_slots_than_adapters(tmp_path, model_dir):
    adapters = make_adapters(model_dir, tmp_path)
    llm = watched_llm(model_dir, kv_cache_memory=32 * 30 * 2 * 16 * 3 * 64 * 4)  # 32 blocks: no pressure
    a, b, c = adapters.values()
    # c waits for a slot; the base request and a's second one queue behind it (no overtaking)
    loras = [a, b, c, None, a]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[2]]
    outs = llm.generate(prompts, greedy(8), lora_request=loras, use_tqdm=False)
    assert [o.lora_request for o in outs] == loras
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    check_parity(model_dir, outs, loras, "mixed")
    # three adapters went through two slots: some slot was rewritten, no step held more than two
    assert llm.engine.loras.counters["lora_slot_writes"] >= 3
    assert_steps_kept_the_limit(llm)
    assert any(len(s) == MAX_LORAS for s in llm.steps_seen), "adapters shared steps"
    # speculation ran under adapters (its verify chunks carry the request's slot; parity covers their outputs)
    assert llm.lora_verify_chunks > 0
    # the adapters really move the outputs: a vs the base model on one prompt, c vs a on another
    assert outs[0].outputs[0].token_ids != outs[3].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids != outs[4].outputs[0].token_ids


# -- the tiny model: the mechanics --------------------------------------------------------------

@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_model_dir):
    """B at std 1.0: on the tiny model (tied embeddings) a greedy continuation tends to repeat its
    last token whatever the weights; large enough adapter products break that, so all8's and
    mlp16's outputs differ from the base's and each other's at nearly every position and a request
    that ran under the wrong adapter (or none) fails the PEFT check. qvd4 stays close to the base
    model here: the tiny tests that check outputs use all8 and mlp16."""
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("tiny-engine-loras"), b_std=1.0)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """One engine for the tiny tests: a small KV pool (so long requests preempt), n-gram
    speculation on."""
    llm = watched_llm(tiny_model_dir, kv_cache_memory=TINY_KV_BLOCKS * TINY_BLOCK_BYTES)
    assert llm.engine.kv.pool.num_blocks == TINY_KV_BLOCKS
    return llm


def test_preemption_keeps_each_request_on_its_adapter(llm, adapters, tiny_model_dir):
    a, c = adapters["all8"], adapters["mlp16"]
    engine = llm.engine
    before = engine.stats()
    long_prompts = [[1] + [(7 * i + 13 * j) % 5000 + 100 for j in range(39)] for i in range(5)]
    loras = [a, c, None, a, c]
    outs = llm.generate(long_prompts, greedy(16), lora_request=loras, use_tqdm=False)
    after = engine.stats()
    assert after["preemptions_swap"] + after["preemptions_recompute"] > before["preemptions_swap"] + before["preemptions_recompute"]
    assert any(o.metrics.num_preemptions for o, lora in zip(outs, loras) if lora is not None), "no adapter request preempted"
    # every request, preempted or not, gives PEFT's tokens (teacher-forced): it came back under its own adapter
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    check_parity(tiny_model_dir, outs, loras, "preempted")
    assert_steps_kept_the_limit(llm)


def test_forks_and_one_lora_request_for_every_prompt_and_chat(llm, adapters, tiny_model_dir):
    a, c = adapters["all8"], adapters["mlp16"]
    verify_chunks = llm.lora_verify_chunks
    # n > 1 with one LoRARequest for both prompts: every greedy choice runs under the adapter
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True),
                        lora_request=c, use_tqdm=False)
    assert [o.lora_request for o in outs] == [c, c]
    for out in outs:
        assert len(out.outputs) == 2 and out.outputs[0].token_ids == out.outputs[1].token_ids
    chat = llm.chat([{"role": "user", "content": "Name a colour."}], greedy(6), lora_request=a, use_tqdm=False)
    assert chat[0].lora_request == a
    check_parity(tiny_model_dir, outs + chat, [c, c, a], "fork/chat")
    assert_steps_kept_the_limit(llm)
    # speculation ran under the adapter (PROMPTS[1] repeats itself, so n-grams propose): the
    # parity check above covers the verify chunks' outputs
    assert llm.lora_verify_chunks > verify_chunks


def test_prefix_cache_never_crosses_adapters(llm, adapters):
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


def test_structured_output_under_an_adapter(llm, adapters):
    spec = StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    outs = llm.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec),
                        lora_request=[adapters["mlp16"], None], use_tqdm=False)
    assert [o.outputs[0].text in ("alpha", "beta", "gamma") for o in outs] == [True, True]


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
    assert llm.list_loras() <= {lr.lora_int_id for lr in adapters.values()}  # nothing refused stayed loaded


def test_lora_request_without_enable_lora_is_refused(tiny_model_dir):
    plain = LLM(str(tiny_model_dir), device="cpu", dtype="float32", kv_cache_memory=1 << 20)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        plain.generate([[1, 2, 3]], greedy(2), lora_request=LoRARequest("x", 1, "/nowhere"), use_tqdm=False)


def test_async_engine_fails_only_the_request_whose_adapter_cannot_load(llm, adapters, tiny_model_dir, tmp_path):
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
    assert len(by_id["good"][1]) == len(by_id["base"][1]) == 6
    assert_peft_greedy_many(tiny_model_dir, [(a.lora_path, PROMPTS[0], by_id["good"][1], "good"),
                                             (None, PROMPTS[2], by_id["base"][1], "base")])
    assert stats == {"running": {}, "waiting": {}, "max_lora": MAX_LORAS}
    assert added and adapters["qvd4"].lora_int_id in loaded
    assert not engine.requests


def test_the_cpu_cache_shrinks_back_once_a_burst_of_adapters_is_done(adapters, tiny_model_dir):
    """More distinct adapters in flight than ``max_cpu_loras`` are all held while they run (none
    is dropped under its request), and only the most recent ``max_cpu_loras`` stay once the
    requests are done, whether they finished or were aborted (helper-58: three stayed for good)."""
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16,
              max_cpu_loras=1, kv_cache_memory=TINY_KV_BLOCKS * TINY_BLOCK_BYTES)
    loras = list(adapters.values())
    outs = llm.generate([PROMPTS[0]] * 3, greedy(2), lora_request=loras, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    assert len(llm.list_loras()) == 1
    engine = llm.engine
    for i, lora in enumerate(loras):
        engine.add_request(f"held-{i}", PROMPTS[1], greedy(30), lora_request=lora)
    while engine.loras.loading or any(r.lora_loading for r in engine.requests.values()):
        engine.step()
    assert len(llm.list_loras()) == 3  # every adapter in flight stays
    for i in range(3):
        engine.abort(f"held-{i}")
    assert not engine.requests and len(llm.list_loras()) == 1


def test_a_lora_path_may_be_a_path_object_and_bad_fields_are_refused(tmp_path):
    from pathlib import Path

    assert LoRARequest("a", 1, Path("/x/y")).lora_path == "/x/y"
    for args, field in [(("a", 1, 5), "lora_path"), (("a", True, "/x"), "lora_int_id"), ((b"a", 1, "/x"), "lora_name"),
                        (("a", 0, "/x"), "lora_int_id")]:
        with pytest.raises(ValueError, match=field):
            LoRARequest(*args)
