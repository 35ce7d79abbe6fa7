"""The plain description of one forward pass that the engine hands the model runner.

The runner knows nothing of scheduling; it only needs, per sequence, which tokens to compute,
where they start, which KV blocks hold the sequence, and whether to return logits for its last
token. Decode chunks come first: attention runs them as one batched call, each token a decode
row over its causal prefix; the other chunks run through the prefill (extend) kernel.

Which kernel computes a position must not depend on how the scheduler cut the work, or a
request's bits would depend on its neighbours (the two kernels sum in different orders, and in
the CPU bf16 mode round differently). So the engine marks a chunk ``decode`` by its positions: a
sequence's output positions (at or past its prompt's length) are decode rows, its prompt
positions are extended, whether the prompt's last token follows a prefix-cache hit, ends a
chunked prefill or belongs to a recomputed sequence (whose recompute is split into its prompt
part, extended, and its output part, decode rows).

A *verify* chunk (``num_draft > 0``, speculative decoding) is a decoding sequence's last token
followed by ``num_draft`` draft tokens: every one of its positions needs logits, and each of its
tokens attends as a decode row of its own (query ``i`` over positions ``0 .. start_pos + i``),
so verification runs through the batched decode kernel rather than one prefill call per sequence.
Verify chunks go right after the plain decodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SeqChunk:
    token_ids: list[int]  # the tokens to compute this step
    start_pos: int  # position of token_ids[0]; tokens before it are in the KV cache
    block_ids: list[int]  # the sequence's block table (covers start_pos + len(token_ids) tokens)
    needs_logits: bool  # the chunk ends at the sequence's last token: sample its next token
    num_draft: int = 0  # a verify chunk: logits for each of its 1 + num_draft positions
    lora_slot: int = -1  # the device LoRA slot its tokens run under; -1 is the base model
    # only the argmax of the logits row is wanted (greedy, nothing reads or changes the logits):
    # the row may come back as that token's one-hot log-distribution (0 there, -inf elsewhere)
    argmax_only: bool = False
    # attention runs each token as a decode row (a decode chunk, see the module docstring); None:
    # a one-token or verify chunk is one (callers that build batches by hand)
    decode: bool | None = None

    def __post_init__(self) -> None:
        if self.decode is None:
            self.decode = len(self.token_ids) == 1 or self.num_draft > 0


@dataclass(slots=True)
class Batch:
    chunks: list[SeqChunk]
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device blocks
