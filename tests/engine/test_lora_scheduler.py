"""LoRA scheduling step by step on the tiny model: the ``max_loras`` limit on every step, no
starvation of a rare adapter under a continuous flood of others, no overtaking of a waiting
adapter, and requests whose adapter is still loading (skipped, holding nothing; an abort or a
deadline while loading; a failed load that ends that request alone).

The background load is held back with an event in two tests (``_load`` wrapped, the real loader
still runs): it is the only way to observe the engine while a load is in flight.
"""

from __future__ import annotations

import threading

import pytest

from qworker.engine import EngineConfig, LLMEngine, LoRARequest, SamplingParams
from qworker.engine.sequence import SeqStatus
from tests.engine.lora_support import ALL_MODULES, assert_peft_greedy_many, make_peft_adapter

BLOCK_BYTES_TINY = 2 * 2 * 16 * 2 * 16 * 4  # layers * (k,v) * block * kv_heads * head_dim * fp32


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def loras(tmp_path_factory, tiny_model_dir):
    """B at std 1.0: on the tiny model (tied embeddings) greedy outputs tend to repeat their last
    token whatever the weights; products this large make each adapter's outputs its own, so a
    sequence that came back under the wrong adapter fails the PEFT check."""
    root = tmp_path_factory.mktemp("tiny-loras")
    return [LoRARequest(f"t{i}", i + 1, str(make_peft_adapter(tiny_model_dir, root / f"t{i}", rank=4, seed=20 + i, target_modules=ALL_MODULES,
                                                              b_std=1.0)))
            for i in range(3)]


def make_engine(tiny_model_dir, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 256 * BLOCK_BYTES_TINY)
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", enable_lora=True, max_loras=2,
                                  max_lora_rank=8, max_cpu_loras=3, scheduling_policy="fcfs", **kw))


def step_checked(engine: LLMEngine):
    """One step; asserts the adapter limit on what ran and on what runs next."""
    sched = engine.scheduler.schedule()
    assert len({s.seq.request.lora_int_id for s in sched.scheduled} - {0}) <= 2
    assert len(engine.scheduler.running.loras) <= 2
    return engine._run(sched)


def drain(engine: LLMEngine, max_steps: int = 400) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return
        engine.loras.poll(engine.book, 0.0)
        step_checked(engine)
    raise AssertionError("requests did not finish")


def wait_loaded(engine: LLMEngine) -> None:
    for f in [e.future for e in engine.loras.loading.values()]:
        f.exception(timeout=60)  # done, loaded or not
    engine.loras.poll(engine.book, 0.0)


def test_a_rare_adapter_is_not_starved_by_a_flood_of_two_others(tiny_model_dir, loras):
    a, b, c = loras
    engine = make_engine(tiny_model_dir)
    for lora in loras:
        engine.add_lora(lora)
    prompt = [1, 2, 3, 4, 5]
    flood = []

    def more():  # two new requests of the running adapters
        for lora in (a, b):
            flood.append(engine.add_request(f"flood{len(flood)}", prompt, greedy(3), lora_request=lora))

    more()
    more()
    step_checked(engine)
    rare = engine.add_request("rare", prompt, greedy(3), lora_request=c)
    steps = 0
    while not rare.finished:
        more()  # the flood never stops
        step_checked(engine)
        steps += 1
        assert steps < 60, "the rare adapter starved"
    assert rare.seqs[0].finish_reason == "length"
    # nothing admitted after it overtook it: every flood request that started before it was older
    later = [r for r in flood if r.arrival_order > rare.arrival_order and r.metrics.first_scheduled_time is not None]
    assert all(r.metrics.first_scheduled_time >= rare.metrics.first_scheduled_time for r in later)
    drain(engine)


def test_a_waiting_adapter_is_not_overtaken_by_requests_of_running_ones(tiny_model_dir, loras):
    a, b, c = loras
    engine = make_engine(tiny_model_dir)
    for lora in loras:
        engine.add_lora(lora)
    engine.add_request("a", [1, 2, 3], greedy(6), lora_request=a)
    engine.add_request("b", [1, 2, 3], greedy(6), lora_request=b)
    engine.add_request("c", [1, 2, 3], greedy(2), lora_request=c)
    engine.add_request("a2", [1, 2, 4], greedy(2), lora_request=a)  # could join a's slot, but c is ahead
    engine.add_request("base", [1, 2, 5], greedy(2))  # also behind c: the same rule
    step_checked(engine)
    statuses = {rid: r.seqs[0].status for rid, r in engine.requests.items()}
    assert statuses["a"] is statuses["b"] is SeqStatus.RUNNING
    assert statuses["c"] is statuses["a2"] is statuses["base"] is SeqStatus.WAITING
    order = []
    while engine.has_unfinished():
        for rid, r in engine.requests.items():
            if rid not in order and r.seqs[0].status is SeqStatus.RUNNING:
                order.append(rid)
        step_checked(engine)
    assert order.index("c") < order.index("a2") and order.index("c") < order.index("base")


def test_a_request_whose_adapter_loads_holds_nothing_and_stops_nobody(tiny_model_dir, loras):
    a, b, _ = loras
    engine = make_engine(tiny_model_dir)
    gate = threading.Event()
    load = engine.loras._load

    def held_load(lora):
        gate.wait(60)
        return load(lora)

    engine.loras._load = held_load
    engine.add_request("lora", [1, 2, 3], greedy(3), lora_request=a)
    engine.add_request("aborted", [1, 2, 3], greedy(3), lora_request=b)
    engine.add_request("expired", [1, 2, 3], greedy(3), lora_request=b, deadline=0.0)
    engine.add_request("base", [1, 2, 4], greedy(3))
    assert engine.requests["lora"].lora_loading
    engine.abort("aborted")
    while "base" in engine.requests:
        engine.step()
    waiting = engine.requests["lora"]
    assert waiting.seqs[0].status is SeqStatus.WAITING and not waiting.seqs[0].block_table
    assert "expired" not in engine.requests
    assert engine.lora_stats() == {"running": {}, "waiting": {"t0": 1}, "max_lora": 2}
    gate.set()
    wait_loaded(engine)
    drain(engine)
    assert waiting.seqs[0].finish_reason == "length"
    assert engine.stats()["lora_loads"] == 2 and not engine.requests


def test_a_failed_load_ends_its_requests_alone(tiny_model_dir, loras, tmp_path):
    a = loras[0]
    engine = make_engine(tiny_model_dir)
    engine.add_request("bad1", [1, 2, 3], greedy(3), lora_request=LoRARequest("bad", 50, str(tmp_path / "missing")))
    engine.add_request("bad2", [1, 2, 3], greedy(3), lora_request=LoRARequest("bad", 50, str(tmp_path / "missing")))
    engine.add_request("good", [1, 2, 3], greedy(3), lora_request=a)
    engine.add_request("base", [1, 2, 3], greedy(3))
    bad = [engine.requests["bad1"], engine.requests["bad2"]]
    wait_loaded(engine)
    for req in bad:
        assert req.finished and req.error_code == "invalid_lora" and "could not be loaded" in req.error
        assert req.request_id not in engine.requests
    drain(engine)
    assert engine.stats()["lora_load_failures"] == 1
    assert engine.counters["requests_finished"] == 2


@pytest.mark.parametrize("swap_space", [1 << 20, 0], ids=["swap", "recompute"])
def test_preempted_sequences_come_back_under_the_limit_and_their_adapter(tiny_model_dir, loras, swap_space):
    """A pool too small for the load: sequences of three adapters and the base model are swapped
    out (or recomputed) and come back; every step keeps the limit, and every output is PEFT's
    greedy continuation under the request's adapter (teacher-forced, all in one forward)."""
    prompts = [[1] + [(11 * i + 7 * j) % 900 + 50 for j in range(20)] for i in range(8)]
    which = [None if i % 2 else loras[(i // 2) % 3] for i in range(8)]
    tight = make_engine(tiny_model_dir, kv_cache_memory=7 * BLOCK_BYTES_TINY, swap_space=swap_space)
    for i, (p, lora) in enumerate(zip(prompts, which)):
        tight.add_request(f"r{i}", p, greedy(16), lora_request=lora)
    reqs = list(tight.requests.values())
    wait_loaded(tight)
    drain(tight)
    outs = [r.seqs[0].output_token_ids for r in reqs]
    assert [len(o) for o in outs] == [16] * 8
    assert_peft_greedy_many(tiny_model_dir, [(None if lora is None else lora.lora_path, p, o, f"r{i}")
                                             for i, (p, lora, o) in enumerate(zip(prompts, which, outs))])
    kind = "swap" if swap_space else "recompute"
    assert tight.scheduler.num_preemptions[kind] > 0
