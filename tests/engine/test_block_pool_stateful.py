"""Block-manager invariants under random operation sequences (hypothesis stateful testing).

The machine drives the real ``KVCacheManager`` with sequences that allocate, grow, fork, swap out,
swap in and free, over tiny pools where every path (prefix hits, CoW, eviction, failed
allocations) happens often.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.outputs import RequestMetrics
from qworker.engine.sampling_params import SamplingParams
from qworker.engine.sequence import Request, Sequence

BLOCK = 4


def make_seq(tokens: list[int]) -> Sequence:
    req = Request("r", None, list(tokens), SamplingParams(), 0, 0, RequestMetrics(0.0))
    seq = Sequence(request=req, index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens))
    req.seqs.append(seq)
    return seq


def snapshot(kv: KVCacheManager):
    pool = kv.pool
    return (
        [(b.ref_count, b.block_hash) for b in pool.blocks],
        list(pool._free_unhashed),
        list(pool._free_cached),
        dict(pool._by_hash),
        kv.cpu_pool.num_free,
    )


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(num_blocks=10, block_size=BLOCK, num_cpu_blocks=6, enable_prefix_caching=True)
        self.resident: list[Sequence] = []
        self.swapped: list[Sequence] = []

    # prompts from a small alphabet so that prefixes collide and hits happen
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=14))
    def admit(self, tokens):
        seq = make_seq(tokens)
        hits = self.kv.find_cached_prefix(seq)
        before = snapshot(self.kv)
        num_new = len(tokens) - len(hits) * BLOCK
        if self.kv.allocate_slots(seq, num_new, hits):
            seq.num_computed_tokens += num_new
            self.resident.append(seq)
        else:
            assert snapshot(self.kv) == before, "a failed allocation changed the pool"
            assert seq.block_table == [] and seq.num_computed_tokens == 0

    @precondition(lambda self: self.resident)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.resident))
        seq.token_ids.append(token)
        before = snapshot(self.kv)
        if self.kv.allocate_slots(seq, 1):
            target = seq.block_table[seq.num_computed_tokens // BLOCK]
            assert target.ref_count == 1, "a write into a block another sequence holds (missing copy-on-write)"
            seq.num_computed_tokens += 1
            self.kv.take_copies()
        else:
            assert snapshot(self.kv) == before, "a failed allocation changed the pool"
            seq.token_ids.pop()

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.resident))
        child = make_seq(parent.token_ids)
        child.num_prompt_tokens = parent.num_prompt_tokens
        self.kv.fork(parent, child)
        self.resident.append(child)

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.resident))
        self.resident.remove(seq)
        self.kv.free(seq)

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.resident))
        if self.kv.can_swap_out(seq):
            self.kv.swap_out(seq)
            self.resident.remove(seq)
            self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(self.swapped))
        before = snapshot(self.kv)
        if self.kv.swap_in(seq):
            self.swapped.remove(seq)
            self.resident.append(seq)
            self.kv.take_copies()
        else:
            assert snapshot(self.kv) == before

    @invariant()
    def ref_counts_equal_holders(self):
        holders = [0] * self.kv.pool.num_blocks
        for seq in self.resident:
            for b in seq.block_table:
                holders[b.block_id] += 1
        assert [b.ref_count for b in self.kv.pool.blocks] == holders

    @invariant()
    def free_exactly_when_unheld(self):
        pool = self.kv.pool
        free_ids = set(pool._free_unhashed) | set(pool._free_cached)
        assert len(free_ids) == len(pool._free_unhashed) + len(pool._free_cached), "a block in both free queues"
        for b in pool.blocks:
            assert (b.block_id in free_ids) == (b.ref_count == 0)
            if b.block_id in pool._free_cached:
                assert b.block_hash is not None

    @invariant()
    def prefix_map_consistent(self):
        pool = self.kv.pool
        for h, block_id in pool._by_hash.items():
            assert pool.blocks[block_id].block_hash == h

    @invariant()
    def tables_cover_computed_tokens(self):
        for seq in self.resident:
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens

    @invariant()
    def cpu_blocks_accounted(self):
        held = sum(len(s.cpu_block_ids) for s in self.swapped)
        assert self.kv.cpu_pool.num_free + held == self.kv.cpu_pool.num_blocks

    def teardown(self):
        for seq in self.resident + self.swapped:
            self.kv.free(seq)
        pool = self.kv.pool
        assert pool.num_free == pool.num_blocks, "blocks leaked"
        assert all(b.ref_count == 0 for b in pool.blocks)
        assert self.kv.cpu_pool.num_free == self.kv.cpu_pool.num_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManager = BlockManagerMachine.TestCase
