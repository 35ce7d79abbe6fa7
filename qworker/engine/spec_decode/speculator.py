"""The engine's speculative-decoding collaborator: proposing, verifying, and what it learns.

With ``config.speculative_config`` set, before scheduling each decoding sequence gets an n-gram
draft (``propose``; cut where its grammar refuses a token, where it would pass ``max_tokens`` or
the context; ``auto`` may cap or drop the drafts of a step); the scheduler gives it ``1 +
len(draft)`` tokens and the model returns logits for each of them; ``verify`` samples each
position in order as a plain step would and accepts the draft tokens it reproduces. The step's
update then appends the accepted tokens and the correction or bonus token one at a time, with
every stop rule applied to each (a stop inside the run cuts it there), advances
``num_computed_tokens`` over the accepted ones only and trims the blocks of the rejected ones.
Nothing else changes: preemption, swap, forks, recovery and deadlines see an ordinary decode
whose step happened to produce several tokens.

``Speculator`` owns the configuration, the counters (``SpecDecodeStats``) and the ``auto``
policy; without a configuration it proposes nothing and its counters stay at zero.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from qworker.engine.scheduler import SchedulerOutput
from qworker.engine.sequence import Sequence
from qworker.engine.spec_decode.config import SpeculativeConfig
from qworker.engine.spec_decode.ngram import NgramIndex
from qworker.engine.spec_decode.policy import AutoPolicy
from qworker.engine.spec_decode.stats import SpecDecodeStats
from qworker.engine.spec_decode.verify import verify
from qworker.engine.structured.bitmask import StructuredBitmask


class Speculator:
    def __init__(self, spec: SpeculativeConfig | None, max_model_len: int):
        self.spec = spec
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()
        self.policy = AutoPolicy(spec.num_speculative_tokens) if spec is not None and spec.policy == "auto" else None

    def propose(self, running: list[Sequence]) -> dict[int, list[int]] | None:
        """n-gram drafts for the running sequences that decode this step, by ``seq_id``."""
        spec = self.spec
        if spec is None:
            return None
        drafts: dict[int, list[int]] = {}
        num_decodes = 0
        for seq in running:
            if seq.num_computed_tokens != len(seq.token_ids) - 1:
                continue
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                # a prompt's one-token last chunk: extended, as prompt positions always are
                # (qworker.model.batch), not a verification's decode row; nor could a request with
                # n > 1 keep drafts accepted there (its forks copy only the first sampled token)
                continue
            num_decodes += 1
            # never draft past max_tokens (the bonus token is the last one) or the context
            cap = min(spec.num_speculative_tokens, seq.request.params.max_tokens - seq.num_output_tokens - 1,
                      self.max_model_len - len(seq.token_ids))
            if cap <= 0:
                continue
            if seq.ngram is None:
                seq.ngram = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
            draft = seq.ngram.propose(seq.token_ids, cap)
            if draft and seq.structured is not None:
                draft = self._grammar_prefix(seq, draft)
            if draft:
                drafts[seq.seq_id] = draft
        if self.policy is not None and drafts:
            cap = self.policy.choose_cap(num_decodes, [len(d) for d in drafts.values()])
            drafts = {i: d[:cap] for i, d in drafts.items()} if cap else {}
        return drafts or None

    @staticmethod
    def _grammar_prefix(seq: Sequence, draft: list[int]) -> list[int]:
        """The longest prefix of ``draft`` the grammar allows (verifying a refused token is waste)."""
        st = seq.structured
        if st.is_terminated():
            return []
        n = 0
        try:
            for t in draft:
                if not st.accept(t):
                    break
                n += 1
        finally:
            st.rollback(n)
        return draft[:n]

    @staticmethod
    def verify(logits: torch.Tensor, sampling: list[Sequence], rows: list[int], drafts: list[list[int]], eos_token_ids: set[int],
               generator: torch.Generator, bitmask: StructuredBitmask, filled: Future | None) -> tuple[list[list[int]], list[list]]:
        """Tokens to append per sampling sequence: see ``spec_decode.verify``."""
        return verify(logits, sampling, rows, drafts, eos_token_ids, generator, bitmask=bitmask, filled=filled)

    def observe_verified(self, num_draft: int, num_accepted: int) -> None:
        self.stats.observe(num_draft, num_accepted)
        if self.policy is not None:
            self.policy.observe_draft(num_draft, num_accepted)

    def count_spec_step(self) -> None:
        """A step that verified at least one draft ran to its update."""
        self.stats.num_spec_steps += 1

    def observe_step(self, sched: SchedulerOutput, ran: bool, seconds: float) -> None:
        """After a step: feeds ``auto`` the cost of a step that ran (``ran``) only decodes and
        verifications (its cost is then a function of its rows)."""
        if self.policy is not None and ran and self._decode_only(sched):
            self.policy.observe_step(sched.num_batched_tokens, seconds)

    @staticmethod
    def _decode_only(sched: SchedulerOutput) -> bool:
        """Every chunk is a decode or a verification: the step's cost is a function of its rows."""
        return not sched.copies and all(s.num_new_tokens - len(s.draft) == 1 for s in sched.scheduled)

    def as_dict(self) -> dict:
        return {**self.stats.as_dict(), **(self.policy.stats() if self.policy is not None else {})}
