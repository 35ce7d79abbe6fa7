"""Block tables for sequences: prefix hits, slot allocation, copy-on-write, fork, swap.

Knows nothing of tensors: it hands out block ids and records the copies the model runner must do
before the next forward pass (``take_copies``): swap-outs first (device -> CPU), then swap-ins
(CPU -> device), then copy-on-write (device -> device).

Rules:
- A prefix hit is block-aligned and never covers a sequence's last token (its logits are needed).
- Full blocks are registered in the prefix map when they are *scheduled*, so requests admitted
  in the same step share them (their KV is written earlier in the same forward pass, layer by
  layer, than any attention reads it). Their KV exists only once that step has run: the blocks
  registered since the last ``take_registered`` are the step's, and if it fails the engine
  ``unregister``s them (and recomputes whoever holds them) so no one hits unwritten KV.
- A block is appendable only while one sequence holds it; a write into a shared partial block
  first copies it (copy-on-write).
- Every mutating call either succeeds or raises/returns False having changed nothing.
- Speculative decoding: slots for draft tokens are allocated like any others, but blocks are
  registered only up to ``len(seq.token_ids)`` (accepted tokens; drafts are never in
  ``token_ids``), so a block is hashed only once every token in it is accepted. After
  verification ``trim`` releases the blocks past the accepted tokens (fresh, unhashed ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from qworker.engine.block_pool import Block, BlockPool
from qworker.engine.sequence import Sequence


# the most blocks past a sequence's end that its allocations ask others to take last (block_pool)
ROOM_CAP = 32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class BlockCopies:
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (src device block, dst device block)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.copy)


class CpuBlockPool:
    """The bounded CPU swap space: a plain free list of block ids."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free)
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
    ):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self._copies = BlockCopies()
        self._registered: list[Block] = []  # entered in the prefix map since take_registered
        # prefix-cache counters, in tokens
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.blocks_swapped_out = 0
        self.blocks_swapped_in = 0
        self.cow_copies = 0

    # -- prefix cache --------------------------------------------------------------------------
    def find_cached_prefix(self, seq: Sequence) -> list[Block]:
        """The longest chain of cached blocks matching the start of ``seq`` (no side effects)."""
        return self._cached_chain(seq, (len(seq.token_ids) - 1) // self.block_size)  # never the last token

    def _cached_chain(self, seq: Sequence, max_blocks: int) -> list[Block]:
        """Cached device blocks holding ``seq``'s first full blocks, up to ``max_blocks``.

        A sequence coming back after a recompute preemption asks for its outputs' blocks too;
        those positions are decode rows for it, so a block is taken there only if its writer
        computed them as decode rows as well (its own earlier blocks, or another job's output):
        one whose writer's prompt reached into them (another job whose prompt repeats this one's
        prompt and output) was written by the prefill kernel, which rounds otherwise."""
        if not self.enable_prefix_caching:
            return []
        bs, prompt = self.block_size, seq.num_prompt_tokens
        chain: list[Block] = []
        for i, h in enumerate(seq.full_block_hashes(bs, max_blocks)):
            block = self.pool.lookup(h)
            if block is None or ((i + 1) * bs > prompt and block.decoded_from > max(prompt, i * bs)):
                break
            chain.append(block)
        return chain

    def record_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit

    # -- allocation ----------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_hit_blocks: int = 0) -> int:
        """Fresh device blocks that ``allocate_slots`` would take (including a CoW copy)."""
        total = seq.num_computed_tokens + num_hit_blocks * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - len(seq.block_table) - num_hit_blocks
        return max(need, 0) + (1 if self._needs_cow(seq, num_new_tokens) else 0)

    def _needs_cow(self, seq: Sequence, num_new_tokens: int) -> bool:
        if num_new_tokens == 0 or seq.num_computed_tokens % self.block_size == 0:
            return False
        last = seq.block_table[seq.num_computed_tokens // self.block_size]
        return last.ref_count > 1

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, hits: list[Block] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens of ``seq`` (after taking the prefix
        ``hits`` found by ``find_cached_prefix``, for a sequence with nothing computed yet).
        Returns False, changing nothing, when the pool is short."""
        hits = hits or []
        need = self.blocks_needed(seq, num_new_tokens, len(hits))
        revived = sum(1 for b in hits if b.ref_count == 0)  # hits taken off the free list
        if need > self.pool.num_free - revived:
            return False
        for block in hits:
            self.pool.touch(block)
        seq.block_table.extend(hits)
        seq.num_computed_tokens += len(hits) * self.block_size
        if self._needs_cow(seq, num_new_tokens):
            self._copy_on_write(seq)
            need -= 1
        if need:  # most decode steps need no block: no layout hint to work out
            seq.block_table.extend(self.pool.allocate(need, *self._layout_hint(seq, need)))
        self._register_full_blocks(seq, seq.num_computed_tokens + num_new_tokens)
        return True

    def _layout_hint(self, seq: Sequence, need: int) -> tuple[int | None, int]:
        """``after`` and ``room`` for :meth:`BlockPool.allocate` (layout only, see block_pool): the
        sequence's last block, and the blocks its request may still append, at most ROOM_CAP."""
        after = seq.block_table[-1].block_id if seq.block_table else None
        max_tokens = seq.request.params.max_tokens
        final_len = seq.num_prompt_tokens + (max_tokens if max_tokens is not None else ROOM_CAP * self.block_size)
        room = cdiv(final_len, self.block_size) - len(seq.block_table) - need
        return after, max(0, min(room, ROOM_CAP))

    def _copy_on_write(self, seq: Sequence) -> None:
        i = seq.num_computed_tokens // self.block_size
        shared = seq.block_table[i]
        (fresh,) = self.pool.allocate(1)
        self._copies.copy.append((shared.block_id, fresh.block_id))
        self.pool.free([shared])
        seq.block_table[i] = fresh
        self.cow_copies += 1

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_tokens, len(seq.token_ids)) // bs
        hashes = seq.full_block_hashes(bs, num_full)
        for i in range(num_full):
            block = seq.block_table[i]
            if block.block_hash is None and self.pool.register(block, hashes[i]) is block:
                block.decoded_from = seq.num_prompt_tokens
                self._registered.append(block)

    def take_registered(self) -> list[Block]:
        registered, self._registered = self._registered, []
        return registered

    def unregister(self, blocks: list[Block]) -> None:
        """Drops ``blocks`` from the prefix map (their KV was never written)."""
        for block in blocks:
            self.pool.unregister(block)

    def trim(self, seq: Sequence) -> int:
        """Releases ``seq``'s blocks past its computed tokens (those allocated for rejected draft
        tokens), tail first; returns how many. They were allocated fresh in the verifying step
        and never registered (see the module docstring), so they go back unhashed."""
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        extra = seq.block_table[keep:]
        if extra:
            self.pool.free(reversed(extra))
            del seq.block_table[keep:]
        return len(extra)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks, the partial last one included."""
        for block in parent.block_table:
            self.pool.touch(block)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        if seq.cpu_block_ids:
            self.cpu_pool.free(seq.cpu_block_ids)
            seq.cpu_block_ids = []

    # -- swap ----------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return 0 < len(seq.block_table) <= self.cpu_pool.num_free

    def swap_out(self, seq: Sequence) -> None:
        """Copy every device block of ``seq`` to the CPU pool and release the device blocks (full
        ones keep their hash, so others may still hit them until they are reclaimed)."""
        cpu_ids = self.cpu_pool.allocate(len(seq.block_table))
        self._copies.swap_out.extend((b.block_id, c) for b, c in zip(seq.block_table, cpu_ids))
        self.pool.free(reversed(seq.block_table))
        seq.block_table = []
        seq.cpu_block_ids = cpu_ids
        self.blocks_swapped_out += len(cpu_ids)

    def swap_in_cost(self, seq: Sequence, num_new_tokens: int = 0) -> int:
        """Free device blocks a swap-in takes: fresh ones, plus resident cached-free ones it revives,
        plus the blocks ``num_new_tokens`` more tokens then open. Only full blocks are ever resident,
        so a partial last block comes back as the sequence's own copy: no copy-on-write after it."""
        opened = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.cpu_block_ids)
        return self._swap_in_cost(seq, self._resident_prefix(seq)) + max(0, opened)

    def _swap_in_cost(self, seq: Sequence, resident: list[Block]) -> int:
        return len(seq.cpu_block_ids) - len(resident) + sum(1 for b in resident if b.ref_count == 0)

    def _resident_prefix(self, seq: Sequence) -> list[Block]:
        """Full blocks of ``seq`` still cached on the device: swap-in reuses them, no copy."""
        return self._cached_chain(seq, seq.num_computed_tokens // self.block_size)

    def swap_in(self, seq: Sequence) -> bool:
        resident = self._resident_prefix(seq)
        if self._swap_in_cost(seq, resident) > self.pool.num_free:
            return False
        need = len(seq.cpu_block_ids) - len(resident)
        for block in resident:
            self.pool.touch(block)
        fresh = self.pool.allocate(need, resident[-1].block_id if resident else None)
        self._copies.swap_in.extend(zip(seq.cpu_block_ids[len(resident) :], (b.block_id for b in fresh)))
        seq.block_table = resident + fresh
        self.cpu_pool.free(seq.cpu_block_ids)
        seq.cpu_block_ids = []
        self.blocks_swapped_in += need
        self._register_full_blocks(seq, seq.num_computed_tokens)
        return True

    def take_copies(self) -> BlockCopies:
        copies, self._copies = self._copies, BlockCopies()
        return copies
