"""The step's prepare stage: what the scheduler chose becomes the model's batch and the list of
sampling rows. Nothing here changes request state (a fork is built but not attached), so a step
that fails after it leaves every request as it was."""

from __future__ import annotations

from collections.abc import Callable

from qworker.engine.sampler import argmax_only
from qworker.engine.scheduler import ScheduledSeq, SchedulerOutput
from qworker.engine.sequence import Request, Sequence
from qworker.model.batch import Batch, SeqChunk


def prepare(sched: SchedulerOutput, now: float, lora_slots: dict[int, int] | None = None) -> tuple[list[ScheduledSeq], Batch]:
    """The scheduled chunks in batch order, and the batch (with the step's block copies); ``now``
    is the first scheduled time of those that start. ``lora_slots``: adapter id -> the device
    slot it sits in this step (``LoRAManager.activate``); a chunk runs under its request's
    adapter's slot, the base model's chunks under -1."""
    # decode rows first (plain decodes, verifications, then the output parts of recomputed
    # sequences), then what is extended: attention runs the decode rows as one batched call, and
    # the logits rows come out in this order
    order = sorted(sched.scheduled, key=_batch_rank)
    for s in order:
        m = s.seq.request.metrics
        if m.first_scheduled_time is None:
            m.first_scheduled_time = now
    slots = lora_slots or {}
    parts = [_chunks(s, slots) for s in order]
    decodes = [c for cs in parts for c in cs if c.decode]
    extends = [c for cs in parts for c in cs if not c.decode]
    batch = Batch(chunks=decodes + extends, swap_out=sched.copies.swap_out,
                  swap_in=sched.copies.swap_in, copy=sched.copies.copy)
    return order, batch


def _batch_rank(s: ScheduledSeq) -> int:
    if s.seq.num_computed_tokens + s.num_new_tokens <= s.seq.num_prompt_tokens:
        return 3  # prompt only: extended
    return 0 if s.num_new_tokens == 1 else 1 if s.draft else 2


def _chunks(s: ScheduledSeq, lora_slots: dict[int, int]) -> list[SeqChunk]:
    """The scheduled tokens as chunks: its prompt positions extended, its output positions decode
    rows (see ``qworker.model.batch``); the last chunk carries the logits row."""
    seq = s.seq
    lora = seq.request.lora_int_id
    start = seq.num_computed_tokens
    num_plain = s.num_new_tokens - len(s.draft)
    token_ids = seq.token_ids[start : start + num_plain] + s.draft
    # how many are prompt positions; a verification's rows stay together (and the speculator
    # drafts only past the prompt, so none of them is one)
    split = 0 if s.draft else min(max(seq.num_prompt_tokens - start, 0), len(token_ids))
    common = dict(block_ids=[b.block_id for b in seq.block_table], lora_slot=lora_slots[lora] if lora else -1)
    last = dict(needs_logits=s.samples, num_draft=len(s.draft), argmax_only=s.samples and not s.draft and argmax_only(seq))
    if split == len(token_ids):
        return [SeqChunk(token_ids=token_ids, start_pos=start, decode=False, **last, **common)]
    out = [SeqChunk(token_ids=token_ids[:split], start_pos=start, needs_logits=False, decode=False, **common)] if split else []
    return out + [SeqChunk(token_ids=token_ids[split:], start_pos=start + split, decode=True, **last, **common)]


def sampling_rows(order: list[ScheduledSeq], new_fork: Callable[[Request, int, Sequence], Sequence],
                  ) -> tuple[list[Sequence], list[int], list[list[int]], int]:
    """The sequences that sample this step, with their (first) logits rows and drafts (a
    verifying sequence has ``1 + len(draft)`` consecutive rows); a request whose prompt just
    finished brings its ``n - 1`` forks (``new_fork(req, index, parent)``: new, not yet
    attached, so nothing changes here)."""
    sampling: list[Sequence] = []
    rows: list[int] = []
    drafts: list[list[int]] = []
    num_rows = 0
    for s in order:
        if not s.samples:
            continue
        seq = s.seq
        sampling.append(seq)
        rows.append(num_rows)
        drafts.append(s.draft)
        req = seq.request
        if req.params.n > 1 and not req.forked:
            for i in range(1, req.params.n):
                sampling.append(new_fork(req, i, seq))
                rows.append(num_rows)
                drafts.append([])
        num_rows += 1 + len(s.draft)
    return sampling, rows, drafts, num_rows
