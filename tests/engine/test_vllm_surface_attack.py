"""The offline engine driven as a vLLM user would, with the calls that broke it: an interrupt
inside a step, vLLM's ``TokensPrompt`` with its text, logit biases too large for float32,
``chat_template_kwargs``, numpy scalars in ``SamplingParams`` and the order of a logprobs dict.
One real SmolLM2 engine for the module (a small KV pool and a short context keep it fast)."""

from __future__ import annotations

import numpy as np
import pytest

from qworker.engine import LLM, SamplingParams

TEXT = "Once upon a time in a land far away there lived a king who had three daughters. " * 6


@pytest.fixture(scope="module")
def llm(model_dir):
    # 64-token steps: a ~110-token prompt is prefilled in two chunks, so a step can fail after
    # an earlier one wrote (and registered) the first blocks
    return LLM(str(model_dir), kv_cache_memory=8 << 20, max_model_len=256, max_num_batched_tokens=64)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def _idle(llm: LLM, free_before: int) -> None:
    e = llm.engine
    assert not e.requests and not e.scheduler.waiting and not e.scheduler.running and not e.scheduler.swapped
    assert e.kv.pool.num_free == free_before, "a KV block leaked"


def _uncached(llm: LLM, prompt, params) -> list[int]:
    """The output with the prefix cache out of the way (neither hit nor filled): the reference."""
    kv = llm.engine.kv
    kv.enable_prefix_caching = False
    try:
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        kv.enable_prefix_caching = True


class _Interrupt:
    """Raises KeyboardInterrupt (Ctrl-C) the ``nth`` time the wrapped engine method is called."""

    def __init__(self, owner, name: str, nth: int):
        self.owner, self.name, self.left = owner, name, nth
        self.real = getattr(owner, name)
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt
        return self.real(*args, **kwargs)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.real)


@pytest.mark.parametrize("where", ["forward", "schedule"])
def test_an_interrupted_step_leaves_no_unwritten_block_in_the_prefix_cache(llm, where):
    """Ctrl-C in the second prefill step (in the forward, or in the scheduler after it allocated
    and registered the step's blocks): the blocks that step registered were never written, so
    the next call on the same prompt must not hit them; it hits only the first chunk's blocks
    and generates exactly what an uncached run does."""
    e = llm.engine
    ids = [int(where == "schedule")] + llm.get_tokenizer().encode(TEXT)  # no block shared between the cases
    assert 96 < len(ids) < 128
    params = greedy(6)
    want = _uncached(llm, [ids], params)
    free = e.kv.pool.num_free
    owner, name = (e.runner, "execute") if where == "forward" else (e.kv, "take_copies")
    fault = _Interrupt(owner, name, 2)
    try:
        with pytest.raises(KeyboardInterrupt):
            # a second prompt sharing the first 96 tokens shares the interrupted step's blocks
            llm.generate([ids, ids[:96] + [5, 6, 7]], params, use_tqdm=False)
    finally:
        fault.restore()
    _idle(llm, free)
    [again] = llm.generate([ids], params, use_tqdm=False)
    assert again.num_cached_tokens == 64, "only the blocks of the step that ran may be hit"
    assert again.outputs[0].token_ids == want
    _idle(llm, free)
    # and the prefix cache still works: the blocks written now are hit, with the same output
    [third] = llm.generate([ids], params, use_tqdm=False)
    assert third.num_cached_tokens == 96 and third.outputs[0].token_ids == want
