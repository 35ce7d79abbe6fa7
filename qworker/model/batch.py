"""The plain description of one forward pass that the engine hands the model runner.

The runner knows nothing of scheduling; it only needs, per sequence, which tokens to compute,
where they start, which KV blocks hold the sequence, and whether to return logits for its last
token. Decode chunks (one token) come first: attention runs them as one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SeqChunk:
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # position of token_ids[0]; tokens before it are in the KV cache
    block_ids: list[int]  # the sequence's block table (covers start_pos + len(token_ids) tokens)
    needs_logits: bool  # the chunk ends at the sequence's last token: sample its next token


@dataclass(slots=True)
class Batch:
    chunks: list[SeqChunk]
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
