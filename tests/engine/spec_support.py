"""Helpers for the speculative-decoding tests: a bigram "model" over a few token ids, so greedy and
sampled outputs mix accepted and rejected drafts (the tiny random model only repeats one token)
and compare exactly, independent of float rounding."""

from __future__ import annotations

import torch

from qworker.engine import LLMEngine

BASE = 1000  # the bigram's token ids: BASE .. BASE + N - 1
N = 24


def spec(k: int = 4, lo: int = 1, hi: int = 3, **kw) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi, **kw}


class Bigram:
    """Wraps ``runner.execute``: the real forward still runs (KV is written as always), but each
    logits row becomes ``W[token at that position]`` over ids ``BASE .. BASE+N`` (-20 elsewhere).
    Rows are mapped from the batch: one per sampling chunk, one per position of a verify chunk."""

    def __init__(self, e: LLMEngine, seed: int = 0, scale: float = 3.0):
        g = torch.Generator().manual_seed(seed)
        self.W = torch.randn(N, N, generator=g) * scale
        self.vocab = e.vocab_size
        self.real = e.runner.execute
        self.rows_seen = 0
        e.runner.execute = self

    def __call__(self, batch):
        logits = self.real(batch)
        toks: list[int] = []
        for c in batch.chunks:
            if c.num_draft:
                toks.extend(c.token_ids)
            elif c.needs_logits:
                toks.append(c.token_ids[-1])
        assert len(toks) == logits.shape[0], (len(toks), logits.shape)
        self.rows_seen += len(toks)
        out = torch.full((len(toks), self.vocab), -20.0)
        if toks:
            out[:, BASE : BASE + N] = self.W[(torch.tensor(toks) - BASE) % N]
        return out


def prompt(rng, n: int) -> list[int]:
    """Bigram tokens with repeats, so n-gram lookups find (right and wrong) continuations."""
    unit = [BASE + rng.randrange(N) for _ in range(rng.randint(3, 8))]
    out = []
    while len(out) < n:
        out += unit if rng.random() < 0.6 else [BASE + rng.randrange(N)]
    return out[:n]
