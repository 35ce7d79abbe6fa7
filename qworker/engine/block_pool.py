"""The device block pool: ref counts, the prefix map, and the free list that is also the LRU.

Invariants (checked by the stateful tests in tests/engine/test_block_pool_stateful.py):
- A block is *held* while ``ref_count > 0``; its holders are the block tables that list it.
  ``ref_count`` equals the number of block-table entries (over all sequences) naming it.
- A block is *free* exactly when ``ref_count == 0``; every free block sits in exactly one of the
  two free queues: ``_free_unhashed`` (no content worth keeping) or ``_free_cached`` (a full block
  whose hash is still in the prefix map, "lazily evicted": it stays hit-able until reclaimed).
- ``block_hash`` is set once a block is full and registered; hashed blocks are immutable.
  The prefix map holds at most one block per hash. The hash is SHA-256 over the parent's hash
  and the block's token ids, so equal hashes mean equal prefixes (no token comparison needed).
- Allocation takes unhashed blocks first, then reclaims cached ones in LRU order (the least
  recently freed first). Reclaiming drops the block's hash from the map: that is an eviction.
- ``allocate`` either returns all the blocks asked for or raises and changes nothing.

Which unhashed block an allocation takes is a choice of layout only (any free block is correct):
it prefers runs of consecutive ids, so that a sequence's pages sit one after another in the pool.
Decode attention on the CPU walks a sequence's pages in order, and the hardware prefetcher streams
across consecutive ones but restarts at every jump: in-order pages made bf16 decode attention 14%
faster than scattered ones (``bench/attention_cpu.py --page-order``). So an allocation continues
right after the caller's last block when that block is free (``after``), else starts a fresh run
at the queue's first block (freed blocks join the queue in id order), and moves the free blocks
just past its end (``room``) to the back of the queue, where other sequences take them last. That is not a
reservation: under pressure those blocks are handed to anyone.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

NONE_HASH = hashlib.sha256(b"qworker prefix root").digest()  # the parent hash of a first block


def hash_block(parent_hash: bytes, token_ids: Iterable[int]) -> bytes:
    """Chained hash of one full block: its tokens and the hash of everything before it.

    Chaining makes a block's hash identify the whole prefix up to it, so the map of hashes is a
    prefix tree with the parent pointer folded into the key. SHA-256 (as vLLM) rather than
    Python's ``hash``: a collision would hand one prompt another prompt's KV.
    """
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    # the prompt length of the sequence that wrote it (set when registered): its positions from
    # there on were written by decode rows, the earlier ones by the prefill kernel
    decoded_from: int = 0


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[Block], None] | None = None):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # dicts used as ordered sets: O(1) removal when a cached-free block is hit again
        self._free_unhashed: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}
        self._on_evict = on_evict
        self.num_evicted = 0

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now (unhashed plus reclaimable cached ones)."""
        return len(self._free_unhashed) + len(self._free_cached)

    @property
    def num_cached_free(self) -> int:
        return len(self._free_cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def lookup(self, block_hash: bytes) -> Block | None:
        block_id = self._by_hash.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    # -- mutations -----------------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None, room: int = 0) -> list[Block]:
        """``n`` blocks, in the order the caller's table will list them. ``after``: the block id
        they follow in that table (the run continues from it where it can); ``room``: how many
        more blocks the caller expects to append (their would-be ids go to the back of the queue).
        """
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        if n == 0:  # most decode steps: the room was set aside when the last block was taken
            return []
        free = self._free_unhashed
        out = []
        next_id = None if after is None else after + 1
        while len(out) < n:
            if next_id not in free:
                next_id = next(iter(free), None)  # a fresh run from the queue's first block
            if next_id is None:
                block_id, _ = self._free_cached.popitem(last=False)
                block = self.blocks[block_id]
                self._evict(block)
            else:
                del free[next_id]
                block = self.blocks[next_id]
                next_id += 1
            block.ref_count = 1
            out.append(block)
        last = out[-1].block_id
        for block_id in range(last + 1, last + 1 + room):  # stops at the first id not free
            if block_id not in free:
                break
            free.move_to_end(block_id)
        return out

    def touch(self, block: Block) -> None:
        """Take one more reference (a prefix hit or a fork); revives a cached-free block."""
        if block.ref_count == 0:
            del self._free_cached[block.block_id]
        block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block. Callers pass a sequence's blocks tail first, so the
        tail of a prompt (least likely to be shared) is reclaimed before its head. Unhashed blocks
        join the queue in id order, so that a later allocation takes them as one ascending run."""
        unhashed = []
        try:
            for block in blocks:
                assert block.ref_count > 0, f"double free of block {block.block_id}"
                block.ref_count -= 1
                if block.ref_count == 0:
                    if block.block_hash is None:
                        unhashed.append(block.block_id)
                    else:
                        self._free_cached[block.block_id] = None
        finally:  # a double free raises mid-way: the blocks already released still join the queue
            for block_id in sorted(unhashed):
                self._free_unhashed[block_id] = None

    def register(self, block: Block, block_hash: bytes) -> Block:
        """Record ``block`` as the cached copy of ``block_hash``; returns the block the map holds
        (an identical block registered earlier wins, and ``block`` stays unhashed)."""
        if block.block_hash is not None:
            return block
        existing = self._by_hash.get(block_hash)
        if existing is not None and existing != block.block_id:
            return self.blocks[existing]
        block.block_hash = block_hash
        self._by_hash[block_hash] = block.block_id
        return block

    def unregister(self, block: Block) -> None:
        """Undo ``register``: the block keeps its holders but is no longer hit-able (a free one
        moves to the unhashed queue)."""
        if block.block_hash is None:
            return
        if self._by_hash.get(block.block_hash) == block.block_id:
            del self._by_hash[block.block_hash]
        block.block_hash = None
        if block.ref_count == 0:
            del self._free_cached[block.block_id]
            self._free_unhashed[block.block_id] = None

    def _evict(self, block: Block) -> None:
        if self._on_evict is not None:
            self._on_evict(block)
        if self._by_hash.get(block.block_hash) == block.block_id:
            del self._by_hash[block.block_hash]
        block.block_hash = None
        self.num_evicted += 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (e.g. after weights change)."""
        while self._free_cached:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            self._free_unhashed[block_id] = None
