"""Turns next-token logits into tokens, one row per sequence, each with its own parameters.

Per-request seeds: a seeded sequence draws from its own ``torch.Generator`` with a fixed number
of draws per token (one exponential per vocabulary entry, the "exponential race": argmax of
p / E with E ~ Exp(1) is a sample from p), so its tokens do not depend on the rest of the batch.
Logprobs are those of the raw model distribution (before logit bias, penalties and temperature),
as vLLM returns by default, each a ``Logprob`` with its rank; for a structured-output row, of the masked distribution (the grammar's
bitmask is applied first, as in vLLM: tokens the grammar forbids get -inf, and the logprobs are
renormalised over the allowed ones).

Greedy rows on the CPU take ``kernels.argmax_rows_cpu`` (torch's argmax reduction reads at ~1 GB/s
here: 3-7 ms for 64 rows of 49152; the kernel reads at memory speed). Same result, ties included:
the first index of the maximum (or of the first NaN), as torch.

``seqs`` may hold ``spec_decode.verify.DraftRow`` stand-ins: the sampler reads only ``request``,
``token_ids``, ``output_token_ids``, ``num_output_tokens``, ``structured`` and ``generator``.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from kernels import argmax_rows_cpu
from qworker.engine.outputs import Logprob, TokenLogprobs
from qworker.engine.sequence import Sequence

if TYPE_CHECKING:
    from qworker.engine.structured import StructuredBitmask, StructuredState


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int], generator: torch.Generator,
           bitmask: StructuredBitmask | None = None, constrained: list[tuple[int, StructuredState]] | None = None,
           filled: Future | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: fp32 ``[len(seqs), vocab]``; returns the sampled ids and per-row logprobs.

    ``bitmask``: masks the rows of sequences with a structured state in place first
    (``constrained``: those ``(row, state)`` pairs, computed here when None; ``filled``: a
    ``bitmask.start_fill`` made for the same rows). 1-D ``logits`` are the rows' greedy tokens
    already (the model's answer when every row is :func:`argmax_only`, ``ModelRunner.execute``)."""
    if logits.dim() == 1:
        return logits.tolist(), [None] * len(seqs)
    if logits.dtype != torch.float32 and not all(map(argmax_only, seqs)):
        logits = logits.float()  # bf16 logits come only for argmax-only rows (ModelRunner.execute)
    if bitmask is not None:
        if constrained is None:
            constrained = [(i, s.structured) for i, s in enumerate(seqs) if s.structured is not None]
        bitmask.apply(logits, constrained, filled=filled)
    raw = logits
    logits = logits.clone(memory_format=torch.contiguous_format) if _needs_processing(seqs) else logits
    _apply_logit_bias(logits, seqs)
    for row, seq in enumerate(seqs):
        p = seq.request.params
        if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
            _apply_penalties(logits[row], seq)
        if seq.num_output_tokens < p.min_tokens:
            # ids are validated at admission; out-of-range ones are skipped here anyway, so one
            # request can never make the sampler raise for the whole batch
            vocab = logits.shape[1]
            banned = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)) if 0 <= t < vocab]
            if banned:
                if seq.structured is not None and seq.structured.is_completed():
                    # the grammar may end here: ban its stop tokens only if it allows anything
                    # else (the grammar wins over min_tokens; a row must never be all -inf)
                    kept = logits[row].clone()
                    kept[banned] = float("-inf")
                    if bool(torch.isfinite(kept).any()):
                        logits[row] = kept
                else:
                    logits[row, banned] = float("-inf")

    greedy = [i for i, s in enumerate(seqs) if s.request.params.greedy]
    if len(greedy) == len(seqs):  # all greedy (the common batch): no row gather
        tokens = _argmax(logits)
    else:
        tokens = torch.empty(len(seqs), dtype=torch.long)
        if greedy:
            tokens[greedy] = _argmax(logits[greedy])
        rand = [i for i, s in enumerate(seqs) if not s.request.params.greedy]
        probs = _filtered_probs(logits[rand], [seqs[i] for i in rand])
        tokens[rand] = _draw(probs, [seqs[i].generator for i in rand], generator).cpu()

    ids = tokens.tolist()
    logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.request.params.logprobs is not None]
    if want:
        lp = torch.log_softmax(raw[want], dim=-1)
        chosen = lp.gather(1, torch.tensor([ids[i] for i in want], device=lp.device).unsqueeze(1))
        # vLLM's rank: how many tokens are at least as likely as the sampled one
        ranks = (lp >= chosen).sum(dim=-1).tolist()
        chosen = chosen.squeeze(1).tolist()
        for j, i in enumerate(want):
            k = seqs[i].request.params.logprobs
            # vLLM's dict: the sampled token first, then the top k (a sampled token among them
            # keeps its first place and takes its top-k rank)
            entry: TokenLogprobs = {ids[i]: Logprob(chosen[j], ranks[j])}
            if k:
                top = torch.topk(lp[j], k)
                for r, (tok, val) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
                    entry[tok] = Logprob(val, r)
            logprobs[i] = entry
    return ids, logprobs


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row argmax on the CPU (int64, CPU tensor)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        return argmax_rows_cpu(logits)  # falls back to torch for layouts it does not take
    return logits.argmax(dim=-1).cpu()


def argmax_only(seq: Sequence) -> bool:
    """Whether :func:`sample` reads nothing of the sequence's next logits row but its argmax:
    greedy, no logprobs, and nothing that changes the row first (logit bias, penalties, a
    min_tokens ban, a grammar's mask). The model may then return the row as the greedy token's
    one-hot log-distribution (``SeqChunk.argmax_only``)."""
    p = seq.request.params
    return (p.greedy and p.logprobs is None and p.structured_outputs is None and seq.structured is None and not p.logit_bias
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and seq.num_output_tokens >= p.min_tokens)


def _needs_processing(seqs: list[Sequence]) -> bool:
    for s in seqs:
        p = s.request.params
        if (p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or s.num_output_tokens < p.min_tokens
                or p.logit_bias):
            return True
    return False


def _apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Adds each row's ``logit_bias`` in one scatter for the whole batch (first of the processing,
    as vLLM's order: before penalties, min_tokens and temperature). A row the grammar masked keeps
    -inf where it was (-inf + bias). Ids past the logits width are skipped (they are refused at
    admission; one request must never make the sampler raise for the whole batch)."""
    vocab = logits.shape[1]
    flat: list[torch.Tensor] = []
    vals: list[torch.Tensor] = []
    for row, seq in enumerate(seqs):
        bias = seq.request.params.logit_bias_tensors()
        if bias is None:
            continue
        ids, values, max_id = bias
        if max_id >= vocab:
            keep = ids < vocab
            ids, values = ids[keep], values[keep]
        flat.append(ids + row * vocab)
        vals.append(values)
    if not flat:
        return
    dev = logits.device
    index = torch.cat(flat).to(dev, non_blocking=True)
    logits.view(-1).put_(index, torch.cat(vals).to(dev, logits.dtype, non_blocking=True), accumulate=True)


def _apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    p = seq.request.params
    vocab = row.shape[0]
    if p.repetition_penalty != 1.0:
        # HF/CTRL semantics over prompt and output tokens: shrink positive logits, grow negative ones
        seen = torch.tensor(sorted(set(t for t in seq.token_ids if t < vocab)), dtype=torch.long, device=row.device)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        out = seq.output_token_ids
        if out:
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=vocab)[:vocab].to(row.device, row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    dev = logits.device
    temps = torch.tensor([s.request.params.temperature for s in seqs], device=dev, dtype=logits.dtype)
    x = logits / temps.unsqueeze(1)
    top_ks = [s.request.params.top_k for s in seqs]
    if any(top_ks):
        vocab = x.shape[1]
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=dev)
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        x = x.masked_fill(x < kth, float("-inf"))
    top_ps = [s.request.params.top_p for s in seqs]
    if any(tp < 1.0 for tp in top_ps):
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = sorted_x.softmax(dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps at least one);
        # rows at top_p 1 keep every token: their fp32 cumsum can reach 1 before the vocabulary
        # ends, and cutting there would make a seeded row's draw depend on its batch
        before = sorted_p.cumsum(dim=-1) - sorted_p
        tp = torch.tensor(top_ps, device=dev, dtype=x.dtype).unsqueeze(1)
        drop = (before >= tp) & (tp < 1.0)
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    probs = x.softmax(dim=-1)
    min_ps = [s.request.params.min_p for s in seqs]
    if any(min_ps):
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, device=dev, dtype=probs.dtype).unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator) -> torch.Tensor:
    noise = torch.empty_like(probs, device="cpu" if probs.device.type == "cpu" else probs.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty((len(unseeded), probs.shape[1]), device=noise.device).exponential_(generator=shared)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)
