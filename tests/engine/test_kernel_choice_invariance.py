"""A position's attention kernel follows from the position, not from how the scheduler cut the
work: prompt positions are extended, output positions are decode rows. The two kernels sum in
different orders (and in the CPU bf16 mode round differently), so when a prompt's last token ran
as a decode row after a prefix-cache hit or at the end of a chunked prefill, or a recomputed
sequence's outputs were extended, a request's tokens changed with its neighbours: in bf16 from
about 33 tokens of context on (helper-70: 5 of 8 greedy sequences after a prefix hit), in fp32
its logprobs by ~1e-5. Real model (SmolLM2-135M), both dtypes, tokens and logprobs bit for bit."""

from __future__ import annotations

import random

import pytest

from qworker.engine import EngineConfig, LLMEngine, SamplingParams

KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64  # layers x (K, V) x kv heads x head dim, times the element size

DTYPES = ["float32", "bfloat16"]


def engine(model_dir, dtype: str, tokens: int, **kw) -> LLMEngine:
    elem = 4 if dtype == "float32" else 2
    return LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, kv_cache_memory=tokens * KV_BYTES_PER_TOKEN * elem, **kw))


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, logprobs=2, ignore_eos=True)


def run(e: LLMEngine) -> dict:
    done = {}
    for _ in range(5000):
        if not e.has_unfinished():
            break
        done.update((r.request_id, r) for r in e.step() if r.finished)
    assert not e.has_unfinished()
    return {rid: (list(r.seqs[0].output_token_ids), r.seqs[0].logprobs) for rid, r in done.items()}


def prompts(seed: int, count: int, length: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(200, 20000) for _ in range(length)] for _ in range(count)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefix_hit_or_a_chunk_split_changes_no_bit(model_dir, dtype):
    alone = engine(model_dir, dtype, 4096, enable_prefix_caching=False)
    cached = engine(model_dir, dtype, 4096)
    chunked = engine(model_dir, dtype, 4096, enable_prefix_caching=False, max_num_batched_tokens=16, max_num_seqs=4)
    for i, prompt in enumerate(prompts(1, 3, 49)):  # three full blocks + 1: the last prompt token alone
        alone.add_request("a", prompt, params(16))
        want = run(alone)["a"]
        cached.add_request(f"warm{i}", prompt, params(1))
        run(cached)
        req = cached.add_request(f"hit{i}", prompt, params(16))
        got = run(cached)[f"hit{i}"]
        assert req.num_cached_tokens == 48
        assert got == want, f"prompt {i}: after a 48-token prefix hit"
        chunked.add_request(f"c{i}", prompt, params(16))  # 16 + 16 + 16 + 1
        assert run(chunked)[f"c{i}"] == want, f"prompt {i}: prefilled in 16-token chunks"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_recomputed_sequence_changes_no_bit(model_dir, dtype):
    """Three requests in a pool that holds about two: the scheduler preempts by recompute (no
    swap space), and the victim's prompt and outputs are computed again."""
    ps = prompts(2, 3, 40)
    alone, want = engine(model_dir, dtype, 4096, enable_prefix_caching=False), {}
    for i, p in enumerate(ps):  # one request at a time
        alone.add_request(f"r{i}", p, params(48))
        want.update(run(alone))
    e = engine(model_dir, dtype, 12 * 16, swap_space=0, enable_prefix_caching=False)
    for i, p in enumerate(ps):
        e.add_request(f"r{i}", p, params(48))
    got = run(e)
    assert e.stats()["preemptions_recompute"] > 0
    assert got == want
