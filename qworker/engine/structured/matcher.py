"""Per-sequence grammar state: which tokens may come next, advanced by each accepted token.

One ``StructuredState`` per sequence, owned by the engine thread (a matcher is not shared across
threads). ``fork()`` deep-copies xgrammar's parse state (``GrammarMatcher.fork``, 0.2.8), so
``n > 1`` children diverge independently. Recompute preemption keeps a sequence's tokens, so its
state stays valid; ``replay`` rebuilds a state from a token list where one has to be made anew
(e.g. a sequence restored without its state), and ``rollback`` undoes accepted tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import xgrammar as xgr


class StructuredState:
    __slots__ = ("grammar", "matcher", "num_accepted", "num_rejected")

    def __init__(self, grammar: xgr.CompiledGrammar, matcher: xgr.GrammarMatcher | None = None, num_accepted: int = 0):
        self.grammar = grammar
        self.matcher = matcher if matcher is not None else xgr.GrammarMatcher(grammar)
        self.num_accepted = num_accepted
        self.num_rejected = 0

    @classmethod
    def replay(cls, grammar: xgr.CompiledGrammar, token_ids: Iterable[int]) -> StructuredState:
        """A fresh state that has accepted ``token_ids`` (generated tokens, not the prompt);
        raises ValueError at the first token the grammar refuses."""
        state = cls(grammar)
        for i, t in enumerate(token_ids):
            if not state.accept(t):
                raise ValueError(f"token {t} at output position {i} does not fit the grammar")
        return state

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token. False (state unchanged) if the grammar refuses it, which
        a masked sample never is; the caller should then end the sequence."""
        if self.matcher.accept_token(int(token_id)):
            self.num_accepted += 1
            return True
        self.num_rejected += 1
        return False

    def is_terminated(self) -> bool:
        """A stop token was accepted after a complete match: the output is finished."""
        return self.matcher.is_terminated()

    def is_completed(self) -> bool:
        """What was accepted so far is a complete match (a stop token may come next)."""
        return self.matcher.is_completed()

    def fork(self) -> StructuredState:
        return StructuredState(self.grammar, self.matcher.fork(), self.num_accepted)

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (CPU int32). A terminated state
        allows only its stop tokens, so a row that outlives its grammar can only stop."""
        if self.matcher.is_terminated():
            fill_only(bitmask, row, self.matcher.stop_token_ids)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def stop_token_ids(self) -> list[int]:
        return self.matcher.stop_token_ids


def fill_only(bitmask: torch.Tensor, row: int, token_ids: Iterable[int]) -> None:
    """``bitmask[row]`` allows exactly ``token_ids``."""
    r = bitmask[row]
    r.zero_()
    for t in token_ids:
        word, bit = divmod(int(t), 32)
        v = 1 << bit
        r[word] = int(r[word]) | (v - (1 << 32) if bit == 31 else v)  # int32 two's complement
