"""Tensor parallelism on CPU (gloo, two ranks): greedy outputs token-identical to one rank on tiny
random models whose heads split unevenly (6 query / 3 KV heads: rank 0 holds KV heads 0-1, rank 1
KV head 2) or are replicated (a Qwen3-MoE with one KV head for two ranks, experts split along
their intermediate dim), with prefix hits and under preemption (a pool of a few blocks: swaps
whose block moves run on both ranks); then the failure path: a follower killed mid-run stops the
engine at once with ExecutorFailed, no request failed or answered, and every spawned rank gone.

Cost: one follower spawn per model (module fixtures) plus one for the kill test; tiny models,
few tokens. Every spawned follower is killed by pid at teardown even when a test fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from qworker.engine import EngineConfig, LLMEngine, SamplingParams
from qworker.engine.async_engine import AsyncEngine
from qworker.model.families.spec import Dims
from qworker.model.parallel.errors import ExecutorFailed
from qworker.model.parallel.shard import plan, split_even
from tests.engine.engine_support import outputs, run
from tests.engine.family_models import build_family_model

BLOCKS = 12  # a pool this small preempts the concurrent batch below
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 4, 5,",
    "Translate to German: good morning",
    "The quick brown fox",
]
MODELS = {
    # uneven split: 6/3 heads and an intermediate of 95 over two ranks
    "llama": dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=95),
    # one KV head replicated on both ranks; experts' intermediate 48 split 24/24; layer 1 dense
    "qwen3_moe": dict(num_attention_heads=4, num_key_value_heads=1),
}


@pytest.fixture(autouse=True)
def _short_collective_timeout(monkeypatch):
    monkeypatch.setenv("QWORKER_TP_TIMEOUT_S", "30")  # a broken group fails well within a test


def kv_bytes(model_dir, tp: int, blocks: int) -> int:
    """Pool bytes that hold ``blocks`` blocks of 16 tokens on rank 0 (its share of the KV heads)."""
    from qworker.model.loader import load_config
    from qworker.model.families.spec import dims

    c = load_config(model_dir)
    d = dims(c)
    kv_heads = len(plan(d, 0, tp).kv_heads)
    return blocks * 2 * c.num_hidden_layers * 16 * kv_heads * d.head_dim * 4


def make(model_dir, tp: int, blocks: int = BLOCKS, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), tensor_parallel_size=tp, kv_cache_memory=kv_bytes(model_dir, tp, blocks),
                                  max_num_seqs=8, **kw))


def close(e: LLMEngine) -> None:
    if hasattr(e.runner, "close"):
        e.runner.close()


def followers(e: LLMEngine) -> list:
    return list(e.runner._procs)


@pytest.fixture(scope="module", params=[*sorted(MODELS), "test-model"])
def pair(request, tmp_path_factory, model_dir):
    name = request.param
    if name == "test-model":  # SmolLM2-135M: 9 query / 3 KV heads, split 6/3 and 2/1
        path = model_dir
    else:
        path = build_family_model(name, tmp_path_factory.mktemp(f"tp-{name}"), model_dir, **MODELS[name])
    threads = torch.get_num_threads()
    one = make(path, 1)
    two = make(path, 2)
    try:
        yield name, one, two
    finally:
        procs = followers(two)
        close(two)
        assert all(p.exitcode is not None for p in procs), "a follower outlived its engine"
        # the leader took its share of the cores (cpu_count / tp threads); close() gives them back
        # in the thread that calls it, which for the AsyncEngine test was not this one
        torch.set_num_threads(threads)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def generate(e: LLMEngine, prompts: list[str], n: int) -> dict[str, list]:
    for i, p in enumerate(prompts):
        e.add_request(f"r{e.counters['steps']}-{i}", p, greedy(n))
    return {k.split("-", 1)[1]: outputs(r) for k, r in run(e, max_s=120).items()}


def test_plan_splits_heads_by_kv_group():
    uneven = Dims(hidden=576, num_heads=9, num_kv_heads=3, head_dim=64, vocab=10)  # SmolLM2-135M
    assert [(p.q_heads, p.kv_heads) for p in (plan(uneven, r, 2) for r in range(2))] == [(range(0, 6), range(0, 2)), (range(6, 9), range(2, 3))]
    replicated = Dims(hidden=64, num_heads=4, num_kv_heads=1, head_dim=16, vocab=10)
    assert [(p.q_heads, p.kv_heads) for p in (plan(replicated, r, 2) for r in range(2))] == [(range(0, 2), range(0, 1)), (range(2, 4), range(0, 1))]
    with pytest.raises(ValueError, match="cannot split"):
        plan(Dims(hidden=64, num_heads=6, num_kv_heads=3, head_dim=16, vocab=10), 0, 4)
    assert [len(split_even(95, 2, r)) for r in range(2)] == [48, 47]


def test_config_validation():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(model="-", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="enable_lora"):
        EngineConfig(model="-", tensor_parallel_size=2, enable_lora=True)


@pytest.mark.parametrize("family", ["olmoe", "olmo2", "olmo3"])
def test_a_full_width_qk_norm_is_refused(family):
    from qworker.model.parallel.build import check_supported
    from tests.engine.family_models import family_config

    with pytest.raises(ValueError, match=f"not supported for {family}"):
        check_supported(family_config(family), 2)
    check_supported(family_config("qwen3"), 2)  # a per-head q/k norm splits with its heads


def test_greedy_identical_with_prefix_hits(pair):
    name, one, two = pair
    base = "A long shared system prompt: you are a helpful assistant who answers in one short sentence. Question:"
    prompts = [base + " what is two plus two?", base + " name a colour."]
    for p in prompts:  # one at a time: the second reuses the first's full blocks
        assert generate(two, [p], 6) == generate(one, [p], 6), name
    assert two.stats()["prefix_cache_hits"] > 0 and two.stats()["prefix_cache_hits"] == one.stats()["prefix_cache_hits"]


def test_greedy_identical_under_preemption(pair):
    name, one, two = pair
    want = generate(one, PROMPTS, 24)
    got = generate(two, PROMPTS, 24)
    assert got == want, name
    s1, s2 = one.stats(), two.stats()
    assert s2["preemptions_swap"] + s2["preemptions_recompute"] > 0, "the pool was meant to preempt"
    assert (s2["preemptions_swap"], s2["blocks_swapped_in"]) == (s1["preemptions_swap"], s1["blocks_swapped_in"])
    assert s2["tp_size"] == 2 and s2["tp_allreduce_calls"] > 0 and s2["requests_failed"] == 0


def test_rank_stats_count_every_rank(pair):
    _, _, two = pair
    ranks = two.runner.rank_stats()
    assert len(ranks) == 2 and ranks[0]["steps"] == ranks[1]["steps"] > 0
    # two all-reduces per layer per step on both ranks
    assert ranks[0]["allreduce_calls"] == ranks[1]["allreduce_calls"] == 2 * two.runner.model.num_layers * ranks[0]["steps"]


def kill_mid_run(two: LLMEngine) -> None:
    """The worker's path: AsyncEngine. A follower SIGKILLed while requests run: the leader's next
    collective fails, ``on_fatal`` fires once, every stream raises ExecutorFailed (none gets a
    finish or an error answer, so the worker commits none of them), and nothing is left running."""
    procs = followers(two)
    fatal: list[BaseException] = []
    killed: list[float] = []

    async def one(ae: AsyncEngine, i: int):
        outs = []
        try:
            async for out in ae.generate(f"j{i}", PROMPTS[i], greedy(400)):
                outs.append(out)
                if i == 0 and len(outs) == 2:
                    os.kill(procs[0].pid, signal.SIGKILL)
                    killed.append(time.monotonic())
        except ExecutorFailed as e:
            return outs, e
        return outs, None

    async def scenario():
        ae = AsyncEngine(two)
        ae.on_fatal = fatal.append
        await ae.start()
        try:
            results = await asyncio.wait_for(asyncio.gather(one(ae, 0), one(ae, 1)), timeout=60)
            return results, time.monotonic() - killed[0]
        finally:
            await ae.shutdown()

    results, after = asyncio.run(scenario())
    assert after < 30, f"the leader took {after:.1f} s to notice"
    for outs, err in results:
        assert isinstance(err, ExecutorFailed)
        assert not any(o.finished for o in outs)
    assert len(fatal) == 1 and isinstance(fatal[0], ExecutorFailed)
    assert two.counters["requests_failed"] == 0 and not two.scheduler.suspects
    assert all(p.exitcode is not None for p in procs)


def kill_while_idle(two: LLMEngine) -> None:
    """The watcher notices a death without a step, and the next step raises ExecutorFailed
    instead of isolating requests one by one."""
    procs = followers(two)
    os.kill(procs[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while two.runner.failure is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert isinstance(two.runner.failure, ExecutorFailed)
    two.add_request("after", "hello", greedy(2))
    with pytest.raises(ExecutorFailed):
        two.step()
    assert two.counters["requests_failed"] == 0 and not two.scheduler.suspects


def test_follower_death_is_fatal_and_fast(pair):
    """Last test of each model's fixture (it kills its follower): mid-run on one, idle on the other."""
    name, _, two = pair
    (kill_mid_run if name == "llama" else kill_while_idle)(two)
