"""The block manager with explicit expected block ids (block size 4, tiny pools)."""

from __future__ import annotations

from qworker.engine.kv_cache_manager import KVCacheManager
from tests.engine.test_block_pool_stateful import make_seq


def ids(seq):
    return [b.block_id for b in seq.block_table]


def admit(kv, tokens):
    seq = make_seq(tokens)
    hits = kv.find_cached_prefix(seq)
    num_new = len(tokens) - 4 * len(hits)
    assert kv.allocate_slots(seq, num_new, hits)
    seq.num_computed_tokens = len(tokens)
    return seq, len(hits)


def test_prefix_hit_is_block_aligned_and_never_covers_the_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, hit = admit(kv, list(range(10)))
    assert ids(a) == [0, 1, 2] and hit == 0
    # blocks 3-6 are the room a's request may still grow into (10 prompt + 16 max tokens = 7
    # blocks): the pool hands them out last, so b's fresh block is 7
    assert list(kv.pool._free_unhashed) == [7, 3, 4, 5, 6]
    b, hit = admit(kv, list(range(10)) + [99])
    assert hit == 2 and ids(b)[:2] == [0, 1] and ids(b)[2] == 7
    c, hit = admit(kv, list(range(8)))  # exactly two full blocks: the last token must be recomputed
    assert hit == 1 and ids(c)[0] == 0 and ids(c)[1] != 1
    assert kv.pool.blocks[0].ref_count == 3


def test_lazy_eviction_lru_order_unhashed_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a, _ = admit(kv, [1] * 4 + [2] * 4 + [3] * 2)  # blocks 0,1 full (hashed), 2 partial
    b, _ = admit(kv, [7] * 4 + [8])  # block 3 full, 4 partial
    kv.free(a)  # tail first: 2 (unhashed) goes to the unhashed queue, then 1, 0 to the cached LRU
    kv.free(b)
    assert list(kv.pool._free_cached) == [1, 0, 3]
    assert kv.pool.num_free == 6
    # a new 3-block request takes the unhashed blocks first (5, 2, 4), then evicts nothing
    c, hit = admit(kv, [5] * 9)
    assert hit == 0 and sorted(ids(c)) == [2, 4, 5]
    assert kv.pool.num_evicted == 0
    # the cached blocks are still hit-able; the one new block d needs reclaims the least recently
    # freed cached block that is not being hit: 3
    d, hit = admit(kv, [1] * 4 + [2] * 4 + [3])
    assert hit == 2 and ids(d) == [0, 1, 3]
    assert kv.pool.num_evicted == 1
    assert kv.find_cached_prefix(make_seq([7] * 4 + [8])) == []
    assert not kv.allocate_slots(make_seq([6] * 2), 2), "the pool is full"



def test_fork_shares_partial_block_and_copy_on_write_copies_it():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent, _ = admit(kv, [1, 2, 3, 4, 5, 6])
    child = make_seq(parent.token_ids)
    kv.fork(parent, child)
    assert ids(child) == ids(parent) == [0, 1] and kv.pool.blocks[1].ref_count == 2
    child.token_ids.append(9)
    assert kv.allocate_slots(child, 1)
    copies = kv.take_copies()
    assert copies.copy == [(1, 6)] and ids(child) == [0, 6]  # 2-5: the parent's room (6 + 16 tokens)
    assert kv.pool.blocks[1].ref_count == 1
    parent.token_ids.append(8)
    assert kv.allocate_slots(parent, 1)
    assert not kv.take_copies(), "the parent is the last holder: it writes in place"


def test_swap_round_trip_reuses_resident_prefix():
    kv = KVCacheManager(num_blocks=6, block_size=4, num_cpu_blocks=4)
    a, _ = admit(kv, [1] * 4 + [2] * 4 + [3])
    kv.swap_out(a)
    out = kv.take_copies().swap_out
    assert out == [(0, 0), (1, 1), (2, 2)] and a.block_table == [] and kv.pool.num_free == 6
    assert kv.swap_in(a)
    copies = kv.take_copies()
    # the two full blocks were still cached on the device: only the partial one is copied back
    assert ids(a)[:2] == [0, 1] and copies.swap_in == [(2, ids(a)[2])]
    assert kv.cpu_pool.num_free == 4


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, _ = admit(kv, [1] * 8)
    big = make_seq([2] * 9)
    before = [(b.ref_count, b.block_hash) for b in kv.pool.blocks], kv.pool.num_free
    assert not kv.allocate_slots(big, 9)
    assert ([(b.ref_count, b.block_hash) for b in kv.pool.blocks], kv.pool.num_free) == before
    assert big.block_table == []
