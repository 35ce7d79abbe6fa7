"""Verification: the logits of every draft position -> the tokens a step accepts.

Position ``j`` of a sequence with draft ``d`` is sampled exactly as a non-speculative step would
sample the token after ``d[:j]``: the ordinary sampler (penalties over the prompt plus ``d[:j]``,
``min_tokens`` counted with them, the grammar mask of the state advanced over ``d[:j]``,
temperature, top-k/p, min-p, the request's own generator). The draft token is accepted when the
sample equals it; the first sample that differs (or the one after the last draft token, the bonus)
ends the run.

Why this is the rejection sampler for a point-mass proposal: with proposal ``q = delta_d``,
speculative sampling accepts ``d`` with probability ``min(1, p(d) / q(d)) = p(d)`` and otherwise
draws from ``max(0, p - q)`` renormalised, i.e. ``p`` with ``d`` removed. Drawing ``x ~ p`` and
accepting iff ``x == d`` has the same two branches with the same probabilities, and the drawn
``x`` is the correction token. Greedy is the ``p`` = one-hot case: the longest prefix equal to
the target's argmax, plus the argmax after it.

Positions are sampled in order and a position is only sampled once every earlier draft token was
accepted, so a seeded request draws one vocabulary row of noise per output token, exactly as
without speculation: its outputs are identical with speculation on or off, whatever the batch.

Grammar states are advanced over accepted draft tokens to mask the next position and rolled back
before returning (also on error), so the engine's ``_update`` remains the only place that moves
them for good.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from qworker.engine.sampler import sample

if TYPE_CHECKING:
    from qworker.engine.outputs import TokenLogprobs
    from qworker.engine.sequence import Sequence
    from qworker.engine.structured import StructuredBitmask


class DraftRow:
    """What the sampler reads of a sequence, as it will be once ``extra`` tokens are accepted."""

    __slots__ = ("request", "token_ids", "num_prompt_tokens", "structured", "generator")

    def __init__(self, seq: Sequence, extra: list[int]):
        self.request = seq.request
        self.token_ids = seq.token_ids + extra
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.structured = seq.structured
        self.generator = seq.generator

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def verify(logits: torch.Tensor, seqs: list[Sequence], rows: list[int], drafts: list[list[int]], eos_token_ids: set[int],
           generator: torch.Generator, bitmask: StructuredBitmask | None = None, filled: Future | None = None,
           ) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
    """``logits``: the step's rows; sequence ``i``'s position ``j`` is row ``rows[i] + j`` (``j <=
    len(drafts[i])``). Returns, per sequence, the tokens to append (accepted draft tokens, then
    the correction or bonus token) and their logprobs; ``len(tokens[i]) - 1`` drafts were accepted.
    ``filled``: a bitmask fill started for the position-0 rows (the states as they are now)."""
    dev = logits.device
    pos0 = logits[torch.tensor(rows, device=dev)]
    constrained = [(i, s.structured) for i, s in enumerate(seqs) if s.structured is not None]
    first, first_lp = sample(pos0, seqs, eos_token_ids, generator, bitmask=bitmask if constrained else None,
                             constrained=constrained, filled=filled)
    tokens = [[t] for t in first]
    lps = [[lp] for lp in first_lp]
    advanced: list = []  # grammar states moved over draft tokens, to roll back
    try:
        alive = [i for i, d in enumerate(drafts) if d]
        j = 1
        while alive:
            # sequences whose draft token j-1 was just accepted go on to position j
            alive = [i for i in alive if tokens[i][-1] == drafts[i][j - 1]]
            ctxs = []
            for i in list(alive):
                st = seqs[i].structured
                if st is not None:
                    if not st.accept(drafts[i][j - 1]):  # the mask allowed it: cannot happen
                        alive.remove(i)
                        continue
                    advanced.append(st)
                ctxs.append(DraftRow(seqs[i], drafts[i][:j]))
            if not alive:
                break
            rows_j = torch.tensor([rows[i] + j for i in alive], device=dev)
            cons = [(r, c.structured) for r, c in enumerate(ctxs) if c.structured is not None]
            ids, lp = sample(logits[rows_j], ctxs, eos_token_ids, generator, bitmask=bitmask if cons else None, constrained=cons)
            for i, t, l in zip(alive, ids, lp):
                tokens[i].append(t)
                lps[i].append(l)
            j += 1
            alive = [i for i in alive if len(drafts[i]) >= j]
    finally:
        for st in advanced:
            st.rollback(1)
    return tokens, lps
