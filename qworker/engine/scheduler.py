"""Continuous-batching scheduler: one rule, a token budget per step.

Every sequence has ``num_computed_tokens`` and ``len(token_ids)``; each step hands out up to
``max_num_batched_tokens`` so the first catches up with the second. Running sequences are served
first (decodes and unfinished prefill chunks, in priority order), then swapped-out and waiting ones are taken in one priority order (a swapped sequence
comes back, a waiting one is admitted) while budget, sequence slots and blocks last; the first one
that does not fit stops the rest, so nothing overtakes a better-placed sequence (a request whose
grammar is still compiling is skipped: it holds nothing and stops nobody). Prefill and decode
tokens share one forward pass. At most ``max_num_seqs`` sequences run: forks past that wait
(``add_fork``).

LoRA: the sequences in ``running`` use at most ``max_loras`` distinct adapters (the base model is
no adapter), so every step's adapters fit the device slots. A swapped or waiting sequence whose
adapter is not among the running ones while ``max_loras`` are is a sequence that does not fit:
under the rule above it stops the queue behind it. Running sequences of the other adapters then
drain, no newcomer can keep their adapters in, and once one adapter's last sequence leaves, the
waiting one gets its slot: a rare adapter is never starved by a flood of others (the price is
that requests of running adapters queued behind it wait too). A request whose adapter is still
loading is skipped, like one whose grammar compiles. Forks share their parent's adapter.

Under memory pressure the lowest-priority running sequence not yet scheduled this step is
preempted: swapped to the CPU pool when it has room, recomputed otherwise. Nothing is aborted for
lack of memory. A step that preempts does not swap anything in (that would thrash, and it keeps
CPU blocks freed by a swap-in from being reused by a swap-out of the same step).

After a failed step the engine may name *suspects* (``isolate``): while there are any, a step
schedules only the first suspect's sequences, so a request that breaks every step it is in is
found alone and fails alone.

Speculative decoding: ``schedule(drafts)`` takes draft tokens for decoding running sequences (by
``seq_id``). Such a sequence is scheduled ``1 + len(draft)`` tokens when budget and blocks allow;
a draft is speculative work, cut so that every running sequence after it still gets the tokens
(a decode's one, a prefill's chunk) and the blocks it needs this step, and dropped (not preempting
anyone) when its blocks do not fit. Drafts are not part of
``token_ids``; they travel in ``ScheduledSeq.draft``.
"""

from __future__ import annotations

import bisect
import heapq
import time
from dataclasses import dataclass, field

from qworker.engine.config import EngineConfig
from qworker.engine.kv_cache_manager import BlockCopies, KVCacheManager
from qworker.engine.outputs import EV_PREEMPT_RECOMPUTE, EV_PREEMPT_SWAP, EV_SWAP_IN
from qworker.engine.sequence import Request, SeqStatus, Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # draft tokens included
    draft: list[int] = field(default_factory=list)  # speculative tokens after the last one

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token, so this step produces its next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == len(self.seq.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: BlockCopies = field(default_factory=BlockCopies)
    preempted: list[tuple[Sequence, str]] = field(default_factory=list)  # (seq, "swap" | "recompute")
    swapped_in: list[Sequence] = field(default_factory=list)
    registered: list = field(default_factory=list)  # blocks entered in the prefix map this step
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


class RunningQueue(SortedQueue):
    """The running sequences, counting them per LoRA adapter (``loras``: id -> sequences; the
    base model, id 0, is not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.loras: dict[int, int] = {}

    def add(self, seq: Sequence) -> None:
        super().add(seq)
        lora = seq.request.lora_int_id
        if lora:
            self.loras[lora] = self.loras.get(lora, 0) + 1

    def remove(self, seq: Sequence) -> None:
        super().remove(seq)
        lora = seq.request.lora_int_id
        if lora:
            left = self.loras[lora] - 1
            if left:
                self.loras[lora] = left
            else:
                del self.loras[lora]


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting = SortedQueue()
        self.swapped = SortedQueue()
        self.running = RunningQueue()
        self.max_loras = config.max_loras
        self.num_preemptions = {"swap": 0, "recompute": 0}
        self.suspects: list[Request] = []  # see the module docstring; the first one runs alone
        # keep a little headroom when admitting so a new prefill does not force a preemption at once
        self._watermark_blocks = max(1, int(0.01 * kv.pool.num_blocks))

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.swapped) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.add(seq)

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """A child forked from ``parent`` (whose prompt just finished). With a free sequence slot it
        shares the parent's blocks and decodes from the next step on; without one it waits, holding
        nothing, and is admitted like a recompute (the prompt's full blocks are prefix hits)."""
        if len(self.running) < self.config.max_num_seqs:
            self.kv.fork(parent, child)
            child.status = SeqStatus.RUNNING
            self.running.add(child)
        else:
            self.add(child)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of whichever queue holds it; frees its blocks."""
        queue = self._queue_of(seq)
        if queue is not None:
            queue.remove(seq)
        self.kv.free(seq)

    def requeue(self, seq: Sequence) -> None:
        """Back to waiting with nothing computed (its KV is not trusted): it will be recomputed."""
        self.remove(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.add(seq)

    def _queue_of(self, seq: Sequence) -> SortedQueue | None:
        status = seq.status
        if status is SeqStatus.RUNNING:
            return self.running
        if status is SeqStatus.WAITING:
            return self.waiting if seq in self.waiting else None  # a fork not yet added is in none
        if status is SeqStatus.SWAPPED:
            return self.swapped
        return None

    def _isolated(self) -> Request | None:
        """The suspect that must run alone this step, if any (finished ones are dropped)."""
        while self.suspects and self.suspects[0].finished:
            self.suspects.pop(0)
        return self.suspects[0] if self.suspects else None

    # -- the step ------------------------------------------------------------------------------
    def schedule(self, drafts: dict[int, list[int]] | None = None) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        only = self._isolated() if self.suspects else None
        running = list(self.running)
        # what the running sequences after each position still need this step: a draft is
        # speculative work and never takes a token or a block that one of them needs (a decode's
        # one token, a prefill chunk: delaying a chunk can cost its sequence its place later)
        tokens_after = [0] * len(running)
        blocks_after = [0] * len(running)
        if drafts:
            n = b = 0
            for i in range(len(running) - 1, -1, -1):
                tokens_after[i], blocks_after[i] = n, b
                s = running[i]
                pending = min(len(s.token_ids) - s.num_computed_tokens, budget)
                n += pending
                b += self.kv.blocks_needed(s, pending)

        for i, seq in enumerate(running):
            if budget == 0:
                break
            if seq.seq_id in scheduled_ids or seq.status is not SeqStatus.RUNNING:
                continue
            if only is not None and seq.request is not only:
                continue
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            draft = drafts.get(seq.seq_id) if drafts else None
            if draft and num_new == 1 and len(seq.token_ids) - seq.num_computed_tokens == 1:
                draft = self._fit_draft(seq, draft, budget - 1 - tokens_after[i], blocks_after[i])
                if draft and self.kv.allocate_slots(seq, 1 + len(draft)):
                    out.scheduled.append(ScheduledSeq(seq, 1 + len(draft), list(draft)))
                    scheduled_ids.add(seq.seq_id)
                    budget -= 1 + len(draft)
                    continue
            while not self.kv.allocate_slots(seq, num_new):
                victim = self._pick_victim(scheduled_ids)
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                scheduled_ids.add(seq.seq_id)
                budget -= num_new

        if self.swapped or self.waiting:
            self._take_queued(out, budget, only)

        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        out.copies = self.kv.take_copies()
        out.registered = self.kv.take_registered()
        return out

    def _fit_draft(self, seq: Sequence, draft: list[int], max_tokens: int, later_blocks: int) -> list[int]:
        """``draft`` cut to ``max_tokens`` and, when taking new blocks for it could leave the
        running sequences after it short of the ``later_blocks`` their tokens need this step, cut
        to the blocks the sequence needs anyway: a draft must never cost another sequence its place."""
        draft = draft[: max(0, max_tokens)]
        if not draft:
            return draft
        base = self.kv.blocks_needed(seq, 1)
        if self.kv.pool.num_free - self.kv.blocks_needed(seq, 1 + len(draft)) >= later_blocks:
            return draft
        n = len(draft)
        while n and self.kv.blocks_needed(seq, 1 + n) > base:
            n -= 1
        return draft[:n]

    def _take_queued(self, out: SchedulerOutput, budget: int, only: Request | None) -> None:
        """Swapped and waiting sequences in one priority order; stops at the first that cannot run."""
        for seq in heapq.merge(self.swapped, self.waiting, key=lambda s: s.sort_key):
            if only is not None and seq.request is not only:
                continue
            if seq.request.grammar is not None and seq.structured is None:
                continue  # its grammar is still compiling: skip it, not the rest of the queue
            if seq.request.lora_loading:
                continue  # its adapter is still loading: the same
            if budget == 0:
                break
            if len(self.running) >= self.config.max_num_seqs:
                # isolation may find every slot held by other requests' idle sequences (forks of
                # a suspect cleared before it): free one, or the suspect would wait forever
                victim = self._idle_victim(only) if only is not None and not out.swapped_in else None
                if victim is None:
                    break
                self._preempt(victim, out)
            took = self._take(seq, out, budget, isolated=only is not None)
            # isolation pauses everyone else: make room from them rather than wait for them (not
            # after a swap-in: a swap-out could then reuse the CPU blocks that swap-in reads)
            while took is None and only is not None and not out.swapped_in and (victim := self._idle_victim(only)) is not None:
                self._preempt(victim, out)
                took = self._take(seq, out, budget, isolated=True)
            if took is None:
                break
            budget -= took

    def _take(self, seq: Sequence, out: SchedulerOutput, budget: int, isolated: bool) -> int | None:
        """Resumes or admits ``seq``; the tokens scheduled for it, or None if it cannot run now."""
        lora = seq.request.lora_int_id
        if lora and lora not in self.running.loras and len(self.running.loras) >= self.max_loras:
            return None  # every adapter slot is taken by running sequences (module docstring)
        if seq.status is SeqStatus.SWAPPED:
            # a step that preempts does not swap in (see the module docstring); isolation is
            # short and preempts only to make this room
            if out.preempted and not isolated:
                return None
            return self._resume(seq, out, budget)
        return self._admit(seq, out, budget)

    def _idle_victim(self, only: Request) -> Sequence | None:
        """While ``only`` runs alone: the lowest-priority running sequence of another request."""
        for seq in reversed(list(self.running)):
            if seq.request is not only:
                return seq
        return None

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

    def _resume(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int | None:
        """Swaps ``seq`` back in; returns the tokens scheduled for it (0: it runs from the next
        step on), or None when it does not fit."""
        num_new = len(seq.token_ids) - seq.num_computed_tokens  # 1: the token sampled last
        # room for the blocks it brings back plus the one its next token may open (only when it
        # opens one: a sequence that held the whole pool must be able to come back to it)
        headroom = self._watermark_blocks if self.running else 0
        if self.kv.swap_in_cost(seq, num_new) > self.kv.pool.num_free - headroom:
            return None
        if not self.kv.swap_in(seq):
            return None
        self.swapped.remove(seq)
        out.swapped_in.append(seq)
        seq.request.metrics.events.append((time.time(), EV_SWAP_IN, seq.index))
        seq.status = SeqStatus.RUNNING
        self.running.add(seq)
        num_new = min(num_new, budget)
        if not self.kv.allocate_slots(seq, num_new):
            return 0
        out.scheduled.append(ScheduledSeq(seq, num_new))
        return num_new

    def _admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int | None:
        """Admits a waiting ``seq`` (new, or preempted by recompute); returns the tokens scheduled
        for it, or None when it does not fit now."""
        hits = self.kv.find_cached_prefix(seq)
        num_hit_tokens = len(hits) * self.kv.block_size
        remaining = len(seq.token_ids) - num_hit_tokens
        # Without chunked prefill a prefill waits for a step with room for all of it; one longer
        # than any step (prompt plus output after a recompute) can never get that, so it is chunked.
        if remaining > budget and not self.config.enable_chunked_prefill and remaining <= self.config.max_num_batched_tokens:
            return None
        num_new = min(remaining, budget)
        need = self.kv.blocks_needed(seq, num_new, len(hits))
        revived = sum(1 for b in hits if b.ref_count == 0)
        if need > self.kv.pool.num_free - revived - self._watermark_blocks and self.running:
            return None  # wait for running sequences to free blocks rather than thrash
        if not self.kv.allocate_slots(seq, num_new, hits):
            return None
        req = seq.request
        if not req.admitted:  # later admissions (after a recompute) hit the request's own blocks
            req.admitted = True
            req.num_cached_tokens = num_hit_tokens
        self.kv.record_prefix_query(len(seq.token_ids), num_hit_tokens)
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.add(seq)
        out.scheduled.append(ScheduledSeq(seq, num_new))
        return num_new
