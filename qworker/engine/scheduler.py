"""Continuous-batching scheduler: one rule, a token budget per step.

Every sequence has ``num_computed_tokens`` and ``len(token_ids)``; each step hands out up to
``max_num_batched_tokens`` so the first catches up with the second. Running sequences are served
first (decodes and unfinished prefill chunks, in priority order), then swapped-out ones come back,
then waiting ones are admitted while budget, sequence slots and blocks last. Prefill and decode
tokens share one forward pass.

Under memory pressure the lowest-priority running sequence not yet scheduled this step is
preempted: swapped to the CPU pool when it has room, recomputed otherwise. Nothing is aborted for
lack of memory. A step that preempts does not swap anything in (that would thrash, and it keeps
CPU blocks freed by a swap-in from being reused by a swap-out of the same step).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from qworker.engine.config import EngineConfig
from qworker.engine.kv_cache_manager import BlockCopies, KVCacheManager
from qworker.engine.outputs import EV_PREEMPT_RECOMPUTE, EV_PREEMPT_SWAP, EV_SWAP_IN
from qworker.engine.sequence import SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so this step produces its next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: BlockCopies = field(default_factory=BlockCopies)
    preempted: list[tuple[Sequence, str]] = field(default_factory=list)  # (seq, "swap" | "recompute")
    num_batched_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


class SortedQueue:
    """Sequences ordered by ``sort_key`` (priority, then arrival): the policy in one place."""

    def __init__(self) -> None:
        self._items: list[tuple[tuple, Sequence]] = []

    def add(self, seq: Sequence) -> None:
        bisect.insort(self._items, (seq.sort_key, seq), key=lambda item: item[0])

    def remove(self, seq: Sequence) -> None:
        i = bisect.bisect_left(self._items, seq.sort_key, key=lambda item: item[0])
        while self._items[i][1] is not seq:
            i += 1
        del self._items[i]

    def __iter__(self):
        return iter([s for _, s in self._items])

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, seq: Sequence) -> bool:
        return any(s is seq for _, s in self._items)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting = SortedQueue()
        self.swapped = SortedQueue()
        self.running = SortedQueue()
        self.num_preemptions = {"swap": 0, "recompute": 0}
        # keep a little headroom when admitting so a new prefill does not force a preemption at once
        self._watermark_blocks = max(1, int(0.01 * kv.pool.num_blocks))

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.swapped) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.add(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked child: it shares its parent's blocks and decodes from the next step on."""
        seq.status = SeqStatus.RUNNING
        self.running.add(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of whichever queue holds it; frees its blocks."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        self.kv.free(seq)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.seq_id in scheduled_ids or seq.status is not SeqStatus.RUNNING:
                continue
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = self._pick_victim(scheduled_ids)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                scheduled_ids.add(seq.seq_id)
                budget -= num_new

        if not out.preempted:
            budget = self._resume_swapped(out, budget)
        if not self.swapped:
            self._admit_waiting(out, budget)

        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        out.copies = self.kv.take_copies()
        return out

    def _pick_victim(self, scheduled_ids: set[int]) -> Sequence:
        """The lowest-priority, newest running sequence that this step has not scheduled yet."""
        for seq in reversed(list(self.running)):
            if seq.seq_id not in scheduled_ids:
                return seq
        raise AssertionError("the sequence being scheduled is always a candidate")

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.request.metrics.num_preemptions += 1
        # Swap only sequences in their decode phase: one token behind, so a swap-in needs one
        # block of headroom at most. A half-computed prompt is cheaper to recompute, and most of
        # it usually still hits the prefix cache.
        decoding = seq.num_computed_tokens == len(seq.token_ids) - 1
        if self.config.swap_space > 0 and decoding and self.kv.can_swap_out(seq):
            self.kv.swap_out(seq)
            seq.status = SeqStatus.SWAPPED
            self.swapped.add(seq)
            mode = "swap"
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
            self.waiting.add(seq)
            mode = "recompute"
        self.num_preemptions[mode] += 1
        seq.request.metrics.events.append((time.time(), EV_PREEMPT_SWAP if mode == "swap" else EV_PREEMPT_RECOMPUTE, seq.index))
        out.preempted.append((seq, mode))

    def _resume_swapped(self, out: SchedulerOutput, budget: int) -> int:
        for seq in list(self.swapped):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            num_new = len(seq.token_ids) - seq.num_computed_tokens  # 1: the token sampled last
            # room for the blocks it brings back plus the one its next token may open
            headroom = self._watermark_blocks if self.running else 0
            if self.kv.swap_in_cost(seq) + 1 > self.kv.pool.num_free - headroom:
                break
            if not self.kv.swap_in(seq):
                break
            self.swapped.remove(seq)
            seq.request.metrics.events.append((time.time(), EV_SWAP_IN, seq.index))
            seq.status = SeqStatus.RUNNING
            self.running.add(seq)
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(seq, num_new):  # else it runs from the next step on
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            hits = self.kv.find_cached_prefix(seq)
            num_hit_tokens = len(hits) * self.kv.block_size
            remaining = len(seq.token_ids) - num_hit_tokens
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(remaining, budget)
            need = self.kv.blocks_needed(seq, num_new, len(hits))
            revived = sum(1 for b in hits if b.ref_count == 0)
            if need > self.kv.pool.num_free - revived - self._watermark_blocks and self.running:
                break  # wait for running sequences to free blocks rather than thrash
            if not self.kv.allocate_slots(seq, num_new, hits):
                break
            req = seq.request
            if not req.admitted:  # later admissions (after a recompute) hit the request's own blocks
                req.admitted = True
                req.num_cached_tokens = num_hit_tokens
            self.kv.record_prefix_query(len(seq.token_ids), num_hit_tokens)
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.add(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
