"""Requests and their sequences: the state the scheduler and the output processor share.

A request holds ``n`` sequences (choices). It starts with one; ``n > 1`` forks it into ``n`` right
after the prompt is computed, the children sharing every KV block (copy-on-write).
``num_computed_tokens`` trails ``len(token_ids)``; each step the scheduler lets it catch up, which
covers prefill, chunked prefill, decode, prefix hits and resumption after preemption alike.

A request may run under a LoRA adapter (``lora_request``): every choice runs under it, and its
block hashes chain from the adapter's own root (``prefix_root``), so a block computed under one
adapter is never a prefix hit for another adapter or the base model.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qworker.engine.block_pool import NONE_HASH, Block, hash_block
from qworker.engine.outputs import RequestMetrics, TokenLogprobs
from qworker.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from qworker.engine.lora_request import LoRARequest

    from qworker.engine.detokenizer import IncrementalDetokenizer
    from qworker.engine.spec_decode.ngram import NgramIndex
    from qworker.engine.structured.compiler import CompileHandle
    from qworker.engine.structured.matcher import StructuredState


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not started, or preempted by recomputation
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted; its KV lives in the CPU swap pool
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    request: Request
    index: int  # the choice index within its request
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[Block] = field(default_factory=list)
    cpu_block_ids: list[int] = field(default_factory=list)  # while SWAPPED
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full token blocks
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    detokenizer: IncrementalDetokenizer | None = None
    num_emitted_tokens: int = 0  # output tokens already handed to the caller
    num_emitted_chars: int = 0
    num_emitted_logprobs: int = 0
    finish_reported: bool = False
    suspect_until: int = 0  # after a failed step: runs isolated until this many tokens are computed
    # structured output: the grammar's parse state, advanced by every output token (``_update``);
    # None while the request's grammar compiles, and for unconstrained requests
    structured: StructuredState | None = None
    # speculative decoding: the n-gram index over ``token_ids`` (built on first use; token_ids
    # only grow, so it only ever extends)
    ngram: NgramIndex | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    @property
    def sort_key(self) -> tuple:
        return (*self.request.sort_key, self.index)

    def full_block_hashes(self, block_size: int, num_blocks: int) -> list[bytes]:
        """Hashes of the first ``num_blocks`` full blocks, extended lazily (tokens of a full
        block never change, so a hash once computed stays right)."""
        hashes = self.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self.request.prefix_root
            hashes.append(hash_block(parent, self.token_ids[i * block_size : (i + 1) * block_size]))
        return hashes[:num_blocks]


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_order: int
    metrics: RequestMetrics
    sort_key: tuple = ()
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    num_cached_tokens: int = 0  # tokens the prefix cache supplied at its first admission
    deadline: float | None = None  # time.time() after which it must not start
    admitted: bool = False  # scheduled at least once: usage and deadlines look at the first time only
    error: str | None = None
    error_code: str | None = None
    grammar: CompileHandle | None = None  # structured output: the compile this request waits for
    # LoRA: the adapter every choice runs under (None: the base model), and whether it is still
    # loading (the scheduler skips the request until it is loaded)
    lora_request: LoRARequest | None = None
    lora_loading: bool = False
    # the parent hash of the first block: per adapter, so prefix hits never cross adapters
    prefix_root: bytes = NONE_HASH
    # failed steps this request ran alone in, since it last got past a failure (step_recovery)
    lone_failures: int = 0

    @property
    def lora_int_id(self) -> int:
        """The adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)
