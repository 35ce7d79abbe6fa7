"""Batched token masks: fill the bitmask rows of the constrained sequences, set the rest of their
logits to -inf; unconstrained rows are neither filled nor touched.

The bitmask is xgrammar's: int32 ``[rows, ceil(vocab / 32)]``, bit ``j`` of a row set where
token ``j`` is allowed. It is filled on the CPU (xgrammar's matchers only write host memory);
on CUDA it is copied into a device buffer and applied by ``xgrammar.apply_token_bitmask_inplace``
(its Triton kernel), on the CPU by xgrammar's CPU kernel. Row ``i`` of the bitmask belongs to
logits row ``i``, so ``indices`` name both.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

from qworker.engine.structured.matcher import StructuredState


class StructuredBitmask:
    """One per engine. ``mask_seconds`` / ``mask_steps`` / ``masked_rows`` count the host time the
    caller spends in ``apply`` (fill, or waiting for a ``start_fill``, plus the apply itself; on
    CUDA the apply is only launched, not waited for).

    Fill cost depends on the grammar state, not only on the vocabulary: most states take
    microseconds (xgrammar precomputes their masks), but some cost milliseconds per row (measured
    with xgrammar 0.2.8 on this CPU: inside a JSON string with a small ``maxLength``, 2-18 ms).
    ``start_fill`` overlaps the fill with the model's forward pass (xgrammar releases the GIL).
    """

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", max_threads: int = 1):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.width = xgr.get_bitmask_shape(1, vocab_size)[1]
        self._batch = xgr.BatchGrammarMatcher(max_threads)
        self._host = torch.empty((0, self.width), dtype=torch.int32)
        self._dev: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.mask_seconds = 0.0
        self.last_mask_seconds = 0.0
        self.mask_steps = 0
        self.masked_rows = 0

    def fill(self, num_rows: int, constrained: Sequence[tuple[int, StructuredState]]) -> torch.Tensor:
        """The host bitmask ``[num_rows, width]`` with the constrained rows filled (others stale)."""
        if self._host.shape[0] < num_rows:
            pin = self.device.type == "cuda"
            self._host = torch.empty((max(num_rows, 2 * self._host.shape[0]), self.width), dtype=torch.int32, pin_memory=pin)
        bm = self._host[:num_rows]
        live = [(r, s) for r, s in constrained if not s.is_terminated()]
        if len(live) > 1:
            self._batch.batch_fill_next_token_bitmask([s.matcher for _, s in live], bm, [r for r, _ in live])
        elif live:
            live[0][1].fill(bm, live[0][0])
        for r, s in constrained:
            if s.is_terminated():
                s.fill(bm, r)
        return bm

    def start_fill(self, num_rows: int, constrained: Sequence[tuple[int, StructuredState]]) -> Future[torch.Tensor]:
        """``fill`` on a helper thread, to run while the model computes the logits; hand the
        future to ``apply(..., filled=)``. The states must not advance until then."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="structured-bitmask")
        return self._pool.submit(self.fill, num_rows, list(constrained))

    def apply(self, logits: torch.Tensor, constrained: Sequence[tuple[int, StructuredState]], filled: Future[torch.Tensor] | None = None) -> None:
        """Mask ``logits [rows, vocab]`` in place for the constrained ``(row, state)`` pairs
        (filling their rows now, or taking a ``start_fill`` made for the same rows)."""
        if not constrained:
            return
        t0 = time.perf_counter()
        rows = [r for r, _ in constrained]
        if len(set(rows)) != len(rows):
            raise ValueError("each constrained row may appear once (forks sample from their own repeated rows)")
        bm = filled.result() if filled is not None else self.fill(logits.shape[0], constrained)
        if bm.shape[0] < logits.shape[0]:
            raise ValueError(f"the bitmask was filled for {bm.shape[0]} rows, the logits have {logits.shape[0]}")
        vocab = min(logits.shape[-1], self.vocab_size)
        if logits.shape[-1] > self.vocab_size:  # ids past the grammar's vocabulary are never allowed
            logits[rows, self.vocab_size :] = float("-inf")
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, bm, vocab_size=vocab, indices=rows)
        else:
            dev = self._device_buffer(bm.shape[0], logits.device)
            dev.copy_(bm)  # blocking: the next fill reuses the host buffer
            xgr.apply_token_bitmask_inplace(logits, dev, vocab_size=vocab, indices=rows)
        dt = time.perf_counter() - t0
        self.last_mask_seconds = dt
        self.mask_seconds += dt
        self.mask_steps += 1
        self.masked_rows += len(rows)

    def _device_buffer(self, num_rows: int, device: torch.device) -> torch.Tensor:
        if self._dev is None or self._dev.shape[0] < num_rows or self._dev.device != device:
            self._dev = torch.empty((max(num_rows, self._host.shape[0]), self.width), dtype=torch.int32, device=device)
        return self._dev[:num_rows]

    def stats(self) -> dict:
        return {"mask_seconds": self.mask_seconds, "mask_steps": self.mask_steps, "masked_rows": self.masked_rows}


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A bool ``[vocab_size]`` view of one bitmask row (for tests and debugging)."""
    bits = (bitmask_row.to(torch.int64).unsqueeze(-1) >> torch.arange(32)) & 1
    return bits.flatten()[:vocab_size].bool()
