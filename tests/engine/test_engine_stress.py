"""Random workloads through the whole engine over tiny pools: shared prefixes, forks, priorities,
aborts, swap and recompute all at once. Every request must finish with the same tokens it gets
when run alone (greedy and seeded sampling do not depend on the batch, on preemption or on
prefix hits), and every block must come back."""

from __future__ import annotations

import random

import pytest

from qworker.engine import EngineConfig, LLMEngine, SamplingParams

BLOCK_BYTES_TINY = 2 * 2 * 4 * 2 * 16 * 4  # layers * (k,v) * block 4 * kv_heads * head_dim * fp32


@pytest.mark.parametrize("round_", range(3))
def test_random_workload_over_tiny_pool(tiny_model_dir, round_):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    e = LLMEngine(EngineConfig(
        model=str(tiny_model_dir),
        block_size=4,
        kv_cache_memory=rng.randint(14, 28) * BLOCK_BYTES_TINY,
        swap_space=rng.choice([0, 6, 40, 40]) * BLOCK_BYTES_TINY,
        max_num_batched_tokens=rng.choice([6, 16, 64]),
        max_num_seqs=rng.choice([2, 4, 16]),
    ))
    prefixes = [[rng.randrange(100, 40000) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    expected: dict[str, tuple[list[int], SamplingParams]] = {}
    aborted: set[str] = set()
    finished: dict[str, object] = {}
    next_id = 0
    for step in range(3000):
        if next_id < 24 and rng.random() < 0.3:
            rid = f"r{next_id}"
            next_id += 1
            # long enough that chunked prefill spans several steps and a sequence can be
            # preempted half-way through its prompt
            prompt = rng.choice(prefixes) + [rng.randrange(100, 40000) for _ in range(rng.randint(1, 30))]
            params = SamplingParams(n=rng.choice([1, 1, 1, 2, 3]), max_tokens=rng.randint(1, 12), temperature=rng.choice([0, 1.0]), seed=rng.randrange(100), ignore_eos=True)
            e.add_request(rid, prompt, params, priority=rng.randint(0, 2))
            expected[rid] = (prompt, params)
        if e.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(e.requests))
            e.abort(rid)
            aborted.add(rid)
        for req in e.step():
            if req.finished:
                finished[req.request_id] = req
        if next_id == 24 and not e.has_unfinished():
            break
    assert not e.has_unfinished(), f"seed {seed}: stuck with {len(e.requests)} requests"
    solo = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, kv_cache_memory=200 * BLOCK_BYTES_TINY, enable_prefix_caching=False))
    for rid, (prompt, params) in expected.items():
        if rid in aborted:
            continue
        req = finished[rid]
        solo.add_request(rid, prompt, params)
        alone = None
        while solo.has_unfinished():
            alone = next((r for r in solo.step() if r.finished), alone)
        got = [s.output_token_ids for s in sorted(req.seqs, key=lambda s: s.index)]
        want = [s.output_token_ids for s in sorted(alone.seqs, key=lambda s: s.index)]
        assert len(got) == params.n and all(len(t) == params.max_tokens for t in got), f"seed {seed}"
        assert got == want, f"seed {seed}: {rid} differs from running alone"
    stats = e.stats()
    assert stats["kv_blocks_used"] == 0 and stats["cpu_swap_blocks_used"] == 0, f"seed {seed}: {stats}"
    assert all(b.ref_count == 0 for b in e.kv.pool.blocks)
