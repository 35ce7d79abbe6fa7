"""Speculative decoding with n-gram (prompt-lookup) drafts.

- ``config``: ``SpeculativeConfig``, vLLM's option names, validated once.
- ``ngram``: the proposer: the last n tokens (longest n first) looked up in the prompt and the
  output so far, through an index kept on each sequence.
- ``policy``: when to speculate: always, or ``auto`` (a learned step-cost model against the
  measured acceptance).
- ``verify``: turns the logits of every draft position into accepted tokens, one position at a
  time, with the ordinary sampler, so greedy and seeded outputs equal non-speculative ones.
- ``stats``: vLLM-named counters (``spec_decode_num_drafts`` ...).

- ``speculator``: the engine's collaborator (``Speculator``): proposes each step's drafts before
  ``Scheduler.schedule`` (which gives a decoding sequence ``1 + len(draft)`` tokens), verifies
  them and feeds the policy; the step's update advances ``num_computed_tokens`` over the
  accepted drafts only and trims the block table (``KVCacheManager.trim``).
"""

from qworker.engine.spec_decode.config import SpeculativeConfig
from qworker.engine.spec_decode.ngram import NgramIndex, propose
from qworker.engine.spec_decode.policy import AutoPolicy
from qworker.engine.spec_decode.stats import SpecDecodeStats

__all__ = ["AutoPolicy", "NgramIndex", "SpecDecodeStats", "SpeculativeConfig", "propose"]
