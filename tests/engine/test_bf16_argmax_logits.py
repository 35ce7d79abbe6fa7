"""A bf16 model's logits stay bf16 when every row of a step is argmax-only (DecoderModel._head):
the sampler takes their argmax as they are (kernels.argmax_rows_cpu reads bf16), skipping the fp32
copy; on AMX such a step gets only the tokens (the LM head's GEMM takes each row's argmax itself,
kernels.gemm_cpu.argmax_bf16); a step with any row that needs more than an argmax gets fp32 logits
as before. Tokens and logprobs are the same as an engine whose logits are always full and copied
to fp32."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import argmax_rows_cpu, gemm_cpu
from qworker.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.engine_support import greedy, rand_ids, run


def _engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="bfloat16", kv_cache_memory=64 << 20, max_num_batched_tokens=128))


class Dtypes:
    """Wraps ``runner.execute``: the logits' dtype per step, and whether every row was argmax-only;
    ``widen``: full logits always (no tokens-only head), handed to the sampler as an fp32 copy, as
    the engine did before."""

    def __init__(self, e: LLMEngine, widen: bool = False):
        self.real, self.widen, self.steps = e.runner.execute, widen, []
        e.runner.execute = self
        if widen:
            e.runner.model._greedy_tokens = lambda x: None

    def __call__(self, batch):
        logits = self.real(batch)
        rows = [c.argmax_only for c in batch.chunks if c.needs_logits and not c.num_draft]
        self.steps.append((logits.dtype, bool(rows) and all(rows)))
        return logits.float() if self.widen else logits


def _workload(e: LLMEngine, mixed: bool) -> None:
    rng = random.Random(3)
    for i in range(6):
        e.add_request(f"g{i}", rand_ids(rng, rng.randrange(4, 40)), greedy(rng.randrange(6, 20)))
    if mixed:
        e.add_request("lp", rand_ids(rng, 12), greedy(8, logprobs=2))
        e.add_request("s", rand_ids(rng, 9), SamplingParams(temperature=0.9, seed=5, max_tokens=10, ignore_eos=True))


def _results(done):
    return {rid: [(s.output_token_ids, s.logprobs) for s in r.seqs] for rid, r in done.items()}


@pytest.mark.parametrize("mixed", [False, True], ids=["greedy-only", "with-logprobs-and-sampling"])
def test_bf16_logits_for_argmax_only_steps_decide_the_same_tokens(model_dir, mixed):
    fast = _engine(model_dir)
    seen = Dtypes(fast)
    _workload(fast, mixed)
    got = run(fast)
    ref = _engine(model_dir)
    Dtypes(ref, widen=True)
    _workload(ref, mixed)
    want = run(ref)
    assert all(r.error_code is None for r in got.values())
    assert _results(got) == _results(want)
    # bf16 (on AMX: the tokens) exactly in the steps whose rows are all argmax-only, fp32 in every other step
    short = torch.int64 if gemm_cpu.amx_kernel() == "amx" else torch.bfloat16
    assert all((dtype == short) == all_argmax for dtype, all_argmax in seen.steps)
    assert all(dtype in (short, torch.float32) for dtype, _ in seen.steps)
    assert any(all_argmax for _, all_argmax in seen.steps)
    if mixed:
        assert any(not all_argmax for _, all_argmax in seen.steps)


def test_bf16_argmax_matches_the_fp32_copy():
    """First index of the maximum, first NaN, all -inf rows, ties, as torch on the fp32 copy."""
    gen = torch.Generator().manual_seed(0)
    for cols in (1, 7, 8, 15, 16, 17, 100, 49152):
        x = torch.randn(9, cols, generator=gen).bfloat16()
        x[1, -1] = 30.0
        x[1, 0] = 30.0  # a tie: the first index wins
        x[2, cols // 2] = float("nan")
        x[3] = float("-inf")
        x[4, cols - 1] = float("nan")
        x[5, cols // 3] = float("inf")
        wide = torch.randn(9, cols + 5, generator=gen).bfloat16()[:, 2 : 2 + cols]  # rows stride apart
        for t in (x, wide):
            assert torch.equal(argmax_rows_cpu(t), t.float().argmax(dim=-1)), cols
