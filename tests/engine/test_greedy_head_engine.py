"""The bounded greedy head in the engine (DecoderModel._head, SeqChunk.argmax_only): on the real
model in fp32, a batch mixing plain greedy requests with every kind that needs real logits
(logprobs, penalties, logit bias, min_tokens, sampling, n > 1, a grammar) gives the same tokens
and logprobs as an engine without the head; only plain greedy rows come back one-hot, every
other row holds the full logits; and the rows a wrapper of ``runner.execute`` replaces still
decide the tokens (the one-hot row is a valid logits row, not a side channel)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu as kcpu
from qworker.engine import EngineConfig, LLMEngine, SamplingParams
from qworker.engine.sampler import argmax_only
from qworker.engine.structured.spec import StructuredOutputsParams
from tests.engine.engine_support import greedy, rand_ids, run

pytestmark = pytest.mark.skipif(not kcpu.cpu_kernels_available(), reason="no C compiler for the CPU kernels")


def _engine(model_dir, monkeypatch, head: str) -> LLMEngine:
    monkeypatch.setenv("QWORKER_CPU_LINEAR", "panels")
    monkeypatch.setenv("QWORKER_CPU_GREEDY_HEAD", head)  # "1": built even where it does not pay
    e = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=64 << 20, max_num_batched_tokens=128))
    assert (e.runner.model.greedy_head is not None) == (head == "1")
    return e


class RowKinds:
    """Wraps ``runner.execute``: records, per step, which logits rows were asked for argmax only
    and checks what came back for each."""

    def __init__(self, e: LLMEngine):
        self.real = e.runner.execute
        self.one_hot = self.full = 0
        e.runner.execute = self

    def __call__(self, batch):
        logits = self.real(batch)
        rows = [c.argmax_only for c in batch.chunks if c.needs_logits and not c.num_draft]
        assert len(rows) == logits.shape[0]
        for fast, row in zip(rows, logits):
            finite = torch.isfinite(row)
            if fast:
                assert int(finite.sum()) == 1 and float(row[finite][0]) == 0.0, "an argmax-only row must be one-hot"
                self.one_hot += 1
            else:
                assert bool(finite.all()), "a row that needs logits must hold all of them"
                self.full += 1
        return logits


def _workload(e: LLMEngine, seed: int = 0) -> None:
    rng = random.Random(seed)
    kinds = [
        greedy(24),
        greedy(20),
        greedy(16, logprobs=3),
        greedy(18, repetition_penalty=1.3),
        greedy(18, presence_penalty=0.5, frequency_penalty=0.3),
        greedy(14, logit_bias={1000: 30.0, 2000: -3.0}),
        greedy(16, min_tokens=6),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, n=2, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"])),
        greedy(20),
    ]
    shared = rand_ids(rng, 24)
    for i, params in enumerate(kinds):
        prompt = (shared if i % 3 == 0 else []) + rand_ids(rng, rng.randrange(4, 60))
        e.add_request(f"r{i}", prompt, params)


def _results(done):
    return {rid: [(s.output_token_ids, s.logprobs) for s in sorted(r.seqs, key=lambda s: s.index)]
            for rid, r in done.items()}


def test_same_tokens_and_logprobs_as_without_the_head(model_dir, monkeypatch):
    on = _engine(model_dir, monkeypatch, "1")
    kinds = RowKinds(on)
    _workload(on)
    with_head = run(on)
    off = _engine(model_dir, monkeypatch, "0")
    _workload(off)
    without = run(off)
    assert all(r.error_code is None for r in with_head.values())
    assert _results(with_head) == _results(without)
    assert kinds.one_hot > 50 and kinds.full > 50  # both kinds of row in the same steps


def test_a_wrapper_that_replaces_the_logits_still_decides(model_dir, monkeypatch):
    """Tests and tools wrap ``runner.execute`` and return logits of their own: the tokens follow
    them, not the head's (nothing travels beside the logits)."""
    e = _engine(model_dir, monkeypatch, "1")
    real = e.runner.execute

    def forced(batch):
        logits = real(batch)
        out = torch.zeros_like(logits)
        out[:, 4242] = 1.0
        return out

    e.runner.execute = forced
    e.add_request("a", rand_ids(random.Random(1), 20), greedy(5))
    done = run(e)
    assert done["a"].seqs[0].output_token_ids == [4242] * 5


def test_which_sequences_are_argmax_only(model_dir, monkeypatch):
    e = _engine(model_dir, monkeypatch, "0")
    cases = {
        "plain": (greedy(4), True),
        "logprobs": (greedy(4, logprobs=0), False),
        "repetition": (greedy(4, repetition_penalty=1.1), False),
        "presence": (greedy(4, presence_penalty=0.1), False),
        "frequency": (greedy(4, frequency_penalty=0.1), False),
        "bias": (greedy(4, logit_bias={5: 1.0}), False),
        "min_tokens": (greedy(4, min_tokens=2), False),
        "sampled": (SamplingParams(temperature=0.7, max_tokens=4), False),
        "grammar": (SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[ab]+")), False),
    }
    for rid, (params, _) in cases.items():
        e.add_request(rid, [100, 200, 300], params)
    for rid, (_, want) in cases.items():
        assert argmax_only(e.requests[rid].seqs[0]) is want, rid
    seq = e.requests["min_tokens"].seqs[0]
    seq.output_token_ids.extend([1, 2])  # past min_tokens the ban is gone: argmax only again
    assert argmax_only(seq) is (seq.num_output_tokens >= 2)


def test_an_unknown_setting_is_refused(model_dir, monkeypatch):
    monkeypatch.setenv("QWORKER_CPU_LINEAR", "panels")
    monkeypatch.setenv("QWORKER_CPU_GREEDY_HEAD", "off")
    with pytest.raises(ValueError, match="QWORKER_CPU_GREEDY_HEAD must be 0, 1 or auto"):
        LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", kv_cache_memory=16 << 20))
