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


# -- prompt forms ------------------------------------------------------------------------------
def test_a_tokens_prompt_may_carry_its_text(llm):
    """vLLM's TokensPrompt has an optional ``prompt``: the text of the ids, shown in the output;
    the ids are what runs. A None text is no text."""
    tok = llm.get_tokenizer()
    text = "The capital of France is"
    ids = tok.encode(text)
    [plain] = llm.generate({"prompt_token_ids": ids}, greedy(3), use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": ids, "prompt": text}, {"prompt_token_ids": ids, "prompt": None},
                         {"prompt_token_ids": np.array(ids), "prompt": "shown only"}], greedy(3), use_tqdm=False)
    assert [o.prompt for o in outs] == [text, None, "shown only"]
    assert all(o.prompt_token_ids == ids and o.outputs[0].token_ids == plain.outputs[0].token_ids for o in outs)
    with pytest.raises(ValueError, match=r"\['prompt'\] must be a string"):
        llm.generate({"prompt_token_ids": ids, "prompt": 5}, greedy(3), use_tqdm=False)


def test_numpy_token_id_arrays_are_token_ids(llm):
    ids = llm.get_tokenizer().encode("The capital of France is")
    [want] = llm.generate([ids], greedy(3), use_tqdm=False)
    for form in (np.array(ids), [np.array(ids, dtype=np.int32)], {"prompt_token_ids": np.array(ids, dtype=np.uint16)}):
        [o] = llm.generate(form, greedy(3), use_tqdm=False)
        assert o.prompt_token_ids == ids and o.outputs[0].token_ids == want.outputs[0].token_ids
        assert all(type(t) is int for t in o.prompt_token_ids)
    for bad in (np.array([ids, ids]), np.array([1.0, 2.0]), np.array([], dtype=np.int64)):
        with pytest.raises(ValueError):
            llm.generate({"prompt_token_ids": bad}, greedy(3), use_tqdm=False)


# -- SamplingParams as vLLM code builds them ---------------------------------------------------
def test_numpy_scalars_are_numbers_in_sampling_params(llm):
    """Values computed with numpy (``rng.integers()``, ``np.float32``) are numbers, as they are in
    vLLM's SamplingParams and in ``priority``; they are stored as Python numbers."""
    ids = [5, 6, 7, 8]
    want = llm.generate([ids], SamplingParams(n=2, temperature=0.5, seed=7, max_tokens=4, top_k=20, logprobs=2, ignore_eos=True,
                                              stop_token_ids=[3], logit_bias={42: 1.5}), use_tqdm=False)[0]
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), seed=np.int64(7), max_tokens=np.int32(4), top_k=np.int64(20),
                       logprobs=np.int8(2), ignore_eos=np.bool_(True), stop_token_ids=[np.int64(3)], logit_bias={np.int64(42): np.float64(1.5)})
    assert type(p.n) is int and type(p.temperature) is float and type(p.seed) is int and type(p.ignore_eos) is bool
    assert type(p.stop_token_ids[0]) is int and all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())
    got = llm.generate([ids], p, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    for bad in (dict(n=np.float64(2.0)), dict(max_tokens=np.bool_(True)), dict(temperature=np.float64("nan"))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# -- logit_bias at float32's edges -------------------------------------------------------------
@pytest.mark.parametrize(("bias", "temperature"), [(3e38, 0.7), (1e39, 0.7), (1e300, 1e-4)])
def test_a_huge_logit_bias_forces_its_tokens(llm, bias, temperature):
    """A finite bias past float32's range (or one that overflows once divided by a low
    temperature) must still mean "these tokens": never NaN probabilities and token 0."""
    forced = {5, 6}
    p = SamplingParams(temperature=temperature, seed=1, max_tokens=6, ignore_eos=True, logit_bias={t: bias for t in forced})
    [o] = llm.generate([[5, 6, 7, 8]], p, use_tqdm=False)
    assert set(o.outputs[0].token_ids) <= forced
    p = SamplingParams(temperature=temperature, seed=1, max_tokens=6, ignore_eos=True, logit_bias={t: -bias for t in range(0, 1000)})
    [o] = llm.generate([[5, 6, 7, 8]], p, use_tqdm=False)
    assert all(t >= 1000 for t in o.outputs[0].token_ids)


# -- chat --------------------------------------------------------------------------------------
def test_chat_template_kwargs_override_the_named_arguments(llm):
    """As vLLM: ``chat_template_kwargs`` are applied last, so they win over the named ones."""
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Name a colour."}]
    [o] = llm.chat(msgs, greedy(2), use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False})
    assert o.prompt == tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    cont = msgs + [{"role": "assistant", "content": "My favourite colour is"}]
    [o] = llm.chat(cont, greedy(2), use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False, "continue_final_message": True})
    assert o.prompt.endswith("My favourite colour is")


# -- logprobs ----------------------------------------------------------------------------------
def test_logprobs_dict_starts_with_the_sampled_token(llm):
    """vLLM's order: the sampled token first, then the top N (``next(iter(lp))`` is the token)."""
    [o] = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=1.0, seed=3, max_tokens=12, logprobs=2, ignore_eos=True),
                       use_tqdm=False)
    c = o.outputs[0]
    assert [next(iter(entry)) for entry in c.logprobs] == c.token_ids
    assert any(entry[t].rank > 2 for t, entry in zip(c.token_ids, c.logprobs)), "some sampled token outside the top 2"
    for t, entry in zip(c.token_ids, c.logprobs):
        assert sorted(v.rank for k, v in entry.items() if k != t or v.rank <= 2)[:2] == [1, 2]
