"""Where the pool puts a sequence's blocks: runs of consecutive ids where it can (layout only;
correctness never depends on it). Decode attention on the CPU streams consecutive pages faster
than scattered ones, see qworker/engine/block_pool.py."""

from __future__ import annotations

import random

import pytest

from qworker.engine.block_pool import BlockPool
from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.requests import Request, RequestMetrics
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.sequence import Sequence


def ids(blocks):
    return [b.block_id for b in blocks]


def make_seq(prompt_len: int, max_tokens: int | None, rid: str = "r") -> Sequence:
    tokens = list(range(1000, 1000 + prompt_len))  # distinct from other tests' prefixes
    req = Request(rid, None, list(tokens), SamplingParams(max_tokens=max_tokens), 0, 0, RequestMetrics(0.0))
    seq = Sequence(request=req, index=0, token_ids=list(tokens), num_prompt_tokens=prompt_len)
    req.seqs.append(seq)
    return seq


def test_appends_continue_the_run_and_room_keeps_others_out():
    pool = BlockPool(64)
    a = pool.allocate(3, room=4)
    b = pool.allocate(3, room=4)
    assert ids(a) == [0, 1, 2] and ids(b) == [7, 8, 9]  # 3-6: a's room, taken last
    for _ in range(4):  # the two grow in turn, each into its own room
        a += pool.allocate(1, after=a[-1].block_id)
        b += pool.allocate(1, after=b[-1].block_id)
    assert ids(a) == list(range(0, 7)) and ids(b) == list(range(7, 14))


def test_a_freed_run_comes_back_ascending():
    pool = BlockPool(16)
    a = pool.allocate(6)
    pool.allocate(2)
    pool.free(reversed(a))  # tail first, as sequences free
    pool.allocate(8)  # the never-used blocks 8-15 first
    assert ids(pool.allocate(4)) == [0, 1, 2, 3]  # not 5, 4, 3, 2: one ascending run
    assert ids(pool.allocate(2)) == [4, 5]


def test_room_is_not_a_reservation():
    pool = BlockPool(10)
    a = pool.allocate(2, room=100)
    rest = pool.allocate(8)  # every other block, the room included
    assert sorted(ids(a) + ids(rest)) == list(range(10)) and pool.num_free == 0


def test_cached_blocks_are_not_taken_for_a_run():
    pool = BlockPool(4)
    x = pool.allocate(2)
    pool.register(x[1], b"h")
    pool.free(reversed(x))  # block 1 cached (hit-able), block 0 unhashed
    (y,) = pool.allocate(1, after=0)  # block 1 would continue the run, but it is a cached prefix
    assert y.block_id == 2 and pool.lookup(b"h") is x[1] and pool.num_evicted == 0


def _simulate(kv: KVCacheManager, seed: int, steps: int = 400) -> float:
    """Requests arriving, decoding one token a step and finishing; returns the share of
    neighbouring table entries that are consecutive block ids, over every table at every step."""
    rng = random.Random(seed)
    running: list[Sequence] = []
    adjacent = pairs = 0
    for step in range(steps):
        while len(running) < 24 and rng.random() < 0.5:
            seq = make_seq(rng.randint(16, 256), rng.randint(32, 256), f"r{step}-{len(running)}")
            if not kv.allocate_slots(seq, len(seq.token_ids)):
                break
            seq.num_computed_tokens = len(seq.token_ids)
            running.append(seq)
        for seq in list(running):
            seq.token_ids.append(7)
            assert kv.allocate_slots(seq, 1), "the pool is large enough for this workload"
            seq.num_computed_tokens += 1
            if seq.num_output_tokens >= seq.request.params.max_tokens:
                kv.free(seq)
                running.remove(seq)
        for seq in running:
            t = ids(seq.block_table)
            pairs += len(t) - 1
            adjacent += sum(1 for u, v in zip(t, t[1:]) if v == u + 1)
    return adjacent / pairs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sequences_stay_mostly_contiguous_under_churn(seed):
    class FifoOnly(KVCacheManager):  # the same manager without the layout hints
        def _layout_hint(self, seq, need):
            return None, 0

    share = _simulate(KVCacheManager(num_blocks=1200, block_size=16), seed)
    fifo = _simulate(FifoOnly(num_blocks=1200, block_size=16), seed)
    assert share >= 0.9, share
    assert fifo < 0.7, fifo  # what the hints buy: the same workload from a plain queue
