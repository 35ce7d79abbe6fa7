"""``SpeculativeConfig``: vLLM's ``speculative_config`` keys for the n-gram method, plus ``policy``.

``LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n_max, "prompt_lookup_min": n_min})`` works as in vLLM: every decoding
sequence with a match is given up to ``k`` draft tokens each step. ``"policy": "auto"`` (ours;
vLLM has no such key) drafts only in steps where the learned cost of the extra rows pays for the
tokens they are expected to add (see ``policy.AutoPolicy``).

Defaults of the lookup window follow vLLM: neither bound given -> 5..5; one given -> both equal it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)
POLICIES = ("always", "auto")
MAX_SPECULATIVE_TOKENS = 32  # rows per sequence per step; more only costs on any device we know
MAX_LOOKUP = 64


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    policy: str = "always"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not _is_int(v) or not 1 <= v <= MAX_LOOKUP):
                raise ValueError(f"{name} must be an integer in [1, {MAX_LOOKUP}], got {v!r}")
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if lo > hi:
            raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.policy not in POLICIES:
            raise ValueError(f"speculative_config policy must be one of {POLICIES}, got {self.policy!r}")

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig | None:
        """None, a ``SpeculativeConfig``, or a dict of its fields (unknown keys are an error, as in
        vLLM, so a misspelt option never silently turns speculation off)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or None, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known, key=repr)  # keys need not be strings, nor comparable
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {unknown} (known: {sorted(known)})")
        if "method" not in value:
            raise ValueError("speculative_config needs a 'method' (only 'ngram' is supported)")
        return cls(**value)
