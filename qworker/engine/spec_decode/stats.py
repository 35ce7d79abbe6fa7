"""Speculative-decoding counters, named after vLLM's ``spec_decode`` metrics.

``num_drafts``: sequence-steps that verified a draft; ``num_draft_tokens``: draft tokens
verified; ``num_accepted_tokens``: draft tokens the target agreed with (counted at verification,
before a stop inside the run may cut the output); ``accepted_per_pos[i]``: drafts whose token
``i`` was accepted. Acceptance rate = accepted / drafted; mean acceptance length = 1 + accepted /
drafts (tokens gained per verified draft, the bonus token included, as vLLM reports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0  # steps that verified at least one draft
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        while len(self.drafted_per_pos) < num_draft:
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for i in range(num_draft):
            self.drafted_per_pos[i] += 1
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_spec_steps": self.num_spec_steps,
            "spec_decode_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }
