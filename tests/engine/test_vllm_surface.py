"""The offline engine as a vLLM user calls it: prompt dicts, all-or-nothing ``generate`` calls,
the small vLLM surface (``stop=None``, ``max_tokens=None``, ``Logprob`` entries,
``cumulative_logprob``, ``finished()``, ``use_tqdm``, ``chat``, ``get_tokenizer``) and
``logit_bias``. Tiny random model (fast), except where a real distribution matters."""

from __future__ import annotations

import random

import numpy as np
import pytest

from qworker.engine import LLM, InvalidRequestError, Logprob, SamplingParams, StructuredOutputsParams
from tests.engine.engine_support import BLOCK_BYTES_TINY, engine, greedy, run
from tests.engine.spec_support import BASE, N, Bigram, prompt, spec

TEXT = "The capital of France is"


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), kv_cache_memory=64 * BLOCK_BYTES_TINY, max_model_len=64)


def _idle(llm: LLM) -> None:
    """Nothing of an earlier call is left in the engine."""
    e = llm.engine
    assert not e.requests and not e.scheduler.waiting and not e.scheduler.running and not e.scheduler.swapped
    assert e.stats()["kv_blocks_used"] == 0


# -- prompt forms ------------------------------------------------------------------------------
def test_vllm_prompt_dicts_are_read_as_prompts(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(TEXT)
    [plain] = llm.generate(TEXT, greedy(4), use_tqdm=False)
    [text] = llm.generate({"prompt": TEXT}, greedy(4), use_tqdm=False)
    [tokens] = llm.generate({"prompt_token_ids": ids}, greedy(4), use_tqdm=False)
    assert text.prompt_token_ids == tokens.prompt_token_ids == ids  # not the ids of the word "prompt"
    assert text.outputs[0].token_ids == tokens.outputs[0].token_ids == plain.outputs[0].token_ids
    assert text.prompt == TEXT and tokens.prompt is None
    # a batch of dicts is a batch of prompts (never taken for a chat), mixed with other forms
    other = [5, 6, 7, 8]
    outs = llm.generate([{"prompt": TEXT}, {"prompt_token_ids": other}, TEXT, other, {"prompt_token_ids": np.array(other).tolist()}],
                        greedy(4), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [ids, other, ids, other, other]
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == plain.outputs[0].token_ids
    # numpy token ids are token ids; a tuple of prompts is a batch
    [np_ids] = llm.generate({"prompt_token_ids": [np.int64(t) for t in ids]}, greedy(4), use_tqdm=False)
    assert np_ids.prompt_token_ids == ids
    assert len(llm.generate((TEXT, {"prompt": TEXT}), greedy(2), use_tqdm=False)) == 2
    _idle(llm)


@pytest.mark.parametrize(("prompts", "match"), [
    ({"prompt": TEXT, "multi_modal_data": {"image": object()}}, "multi_modal_data.*not supported"),
    ([{"prompt": TEXT}, {"prompt": TEXT, "multi_modal_data": {"image": 1}}], r"prompts\[1\].*multi_modal_data"),
    ({"prompt_embeds": [0.1]}, "prompt_embeds"),
    ({"encoder_prompt": TEXT, "decoder_prompt": TEXT}, "encoder/decoder"),
    ({"text": TEXT}, r"unknown keys \['text'\]"),
    ({}, "needs 'prompt'"),
    ({"prompt": 5, "prompt_token_ids": [5, 6]}, "must be a string"),
    ({"prompt": ["a", "b"]}, "must be a string"),
    ({"prompt_token_ids": "5 6 7"}, "token ids"),
    ({"prompt_token_ids": [5, True]}, "token ids"),
    ({"role": "user", "content": "hi"}, "chat message"),
    (["hi", {"role": "user", "content": "hi"}], r"prompts\[1\] is a chat message"),
    ([5, 6, "seven"], "mixes token ids"),
    ({"a", "b"}, "list of prompts"),
    ([TEXT, 3.5], r"prompts\[1\]"),
    ([[{"prompt": TEXT}]], "chat messages"),
])
def test_other_prompt_forms_are_refused_clearly(llm, prompts, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompts, greedy(2), use_tqdm=False)
    _idle(llm)


# -- a call is all or nothing ------------------------------------------------------------------
BAD_CALLS = [
    ({"priority": [0, 0, 1.5]}, "priority"),
    ({"priority": [0, 0, np.True_]}, "priority"),
    ({"priority": [0, 0, True]}, "priority"),
    ({"priority": [0, 0]}, "priority"),
    ({"priority": 1}, "priority"),
    ({"sampling_params": [greedy(2), greedy(2), "greedy"]}, "sampling_params"),
    ({"sampling_params": [greedy(2), greedy(2)]}, "sampling_params"),
    ({"lora_request": object()}, "LoRA"),
    ({"use_tqdm": "yes"}, "use_tqdm"),
]


@pytest.mark.parametrize(("kwargs", "match"), BAD_CALLS)
def test_a_bad_value_for_a_later_prompt_queues_nothing(llm, kwargs, match):
    prompts = [[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 10]]
    kwargs = {"sampling_params": greedy(2), "use_tqdm": False, **kwargs}
    before = llm.engine.counters["requests_finished"]
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate(prompts, **kwargs)
    _idle(llm)
    # the next call returns exactly its own outputs, and only its own request ran
    outs = llm.generate([[9, 9, 9]], greedy(2), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[9, 9, 9]]
    assert llm.engine.counters["requests_finished"] == before + 1


@pytest.mark.parametrize("bad_last", [
    [1, 49152],  # a token id past the vocabulary
    list(range(100, 200)),  # longer than the context (max_model_len=64)
    "",  # empty
])
def test_a_bad_later_prompt_queues_nothing(llm, bad_last):
    before = llm.engine.counters["requests_finished"]
    with pytest.raises(InvalidRequestError, match=r"prompts\[2\]"):
        llm.generate([[5, 6, 7], [5, 6, 8], bad_last], greedy(2), use_tqdm=False)
    _idle(llm)
    outs = llm.generate([[9, 9, 9]], greedy(2), use_tqdm=False)
    assert len(outs) == 1 and llm.engine.counters["requests_finished"] == before + 1  # only its own ran


def test_numpy_integer_priorities_are_integers(llm):
    outs = llm.generate([[5, 6, 7], [5, 6, 8]], greedy(2), priority=[np.int64(0), np.int32(-3)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [5, 6, 8]]
    _idle(llm)


class _Interrupt:
    """A tqdm stand-in whose first update raises KeyboardInterrupt: Ctrl-C inside generate()."""

    def __init__(self, **kw):
        self.closed = False

    def update(self, n):
        raise KeyboardInterrupt

    def close(self):
        self.closed = True


def test_an_interrupted_call_aborts_what_it_queued(llm):
    bars = []

    def factory(**kw):
        bars.append(_Interrupt(**kw))
        return bars[-1]

    prompts = [[5, 6, 7, i] for i in range(10, 14)]
    params = [greedy(2), greedy(2), greedy(40), greedy(40)]  # two finish first, two are left mid-run
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, params, use_tqdm=factory)
    assert bars and bars[0].closed
    _idle(llm)
    outs = llm.generate([[9, 9, 9]], greedy(2), use_tqdm=False)
    assert len(outs) == 1 and outs[0].outputs[0].finish_reason == "length"


def test_fcfs_refuses_a_priority_before_queuing_anything(tiny_model_dir):
    fcfs = LLM(str(tiny_model_dir), kv_cache_memory=64 * BLOCK_BYTES_TINY, scheduling_policy="fcfs")
    with pytest.raises(InvalidRequestError, match="scheduling_policy"):
        fcfs.generate([[5, 6, 7], [5, 6, 8]], greedy(2), priority=[0, 1], use_tqdm=False)
    _idle(fcfs)
    assert len(fcfs.generate([[5, 6, 7], [5, 6, 8]], greedy(2), priority=[0, 0], use_tqdm=False)) == 2


# -- the rest of the vLLM surface --------------------------------------------------------------
def test_none_means_none_and_max_tokens_none_runs_to_the_context(llm):
    p = SamplingParams(temperature=0, stop=None, stop_token_ids=None, logit_bias=None, ignore_eos=True, max_tokens=None)
    assert p.stop == [] and p.stop_token_ids == [] and p.max_tokens is None
    prompts = [[5, 6, 7, 8], list(range(100, 140))]
    outs = llm.generate(prompts, p, use_tqdm=False)
    for o, pr in zip(outs, prompts):  # context 64: up to 64 tokens in all, whatever the prompt
        assert len(o.outputs[0].token_ids) == 64 - len(pr) and o.outputs[0].finish_reason == "length"
    assert p.max_tokens is None, "the caller's params are not changed"
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        llm.generate(list(range(100, 140)), SamplingParams(max_tokens=None, min_tokens=30), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1)
    _idle(llm)


def test_logprob_objects_cumulative_logprob_and_finished(llm):
    tok = llm.get_tokenizer()
    [out] = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=3, ignore_eos=True),
                         use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    for t, entry in zip(c.token_ids, c.logprobs):
        assert all(isinstance(v, Logprob) for v in entry.values())
        top = sorted((v for k, v in entry.items()), key=lambda v: -v.logprob)
        ranked = sorted(v.rank for k, v in entry.items() if v.rank <= 3)
        assert ranked == [1, 2, 3] and top[0].rank == 1
        if entry[t].rank <= 3:  # one of the top 3: its rank among them
            assert entry[t].rank == 1 + sum(1 for v in entry.values() if v.logprob > entry[t].logprob)
        else:  # its real rank, below the top 3
            assert entry[t].logprob <= top[2].logprob
        assert all(v.decoded_token == tok.decode([k]) for k, v in entry.items())
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    assert out.prompt_logprobs is None
    # vLLM: RequestOutput.finished is a bool, CompletionOutput.finished() a method; both read as bools
    assert out.finished is True
    assert c.finished() is True and c.finished and c.finished == True  # noqa: E712
    [plain] = llm.generate([[5, 6, 7, 8]], greedy(2), use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None and plain.outputs[0].logprobs is None


def test_chat_renders_the_template_and_generates(llm):
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "Name a colour."}]
    [chat] = llm.chat(msgs, greedy(4), use_tqdm=False)
    want = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert chat.prompt_token_ids == want
    assert chat.prompt == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    [legacy] = llm.generate([msgs], greedy(4), use_tqdm=False)
    assert legacy.outputs[0].token_ids == chat.outputs[0].token_ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
    two = llm.chat([parts, msgs], greedy(4), use_tqdm=False)
    assert [o.prompt_token_ids for o in two] == [want, want]
    with pytest.raises(InvalidRequestError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], use_tqdm=False)
    _idle(llm)


# -- logit_bias --------------------------------------------------------------------------------
def test_logit_bias_is_validated(llm):
    for bad, match in (({"5": 1.0}, "keys"), ({True: 1.0}, "keys"), ({-1: 1.0}, "keys"), ({5: float("nan")}, "finite"),
                       ({5: float("-inf")}, "finite"), ([5, 1.0], "dict")):
        with pytest.raises(InvalidRequestError, match=match):
            SamplingParams(logit_bias=bad)
    with pytest.raises(InvalidRequestError, match="logit_bias token ids out of range"):
        llm.generate([[5, 6, 7]], SamplingParams(logit_bias={49152: 5.0}), use_tqdm=False)
    _idle(llm)


def test_logit_bias_steers_each_row_of_a_batch(llm):
    prompts = [[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 10]]
    free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(6), use_tqdm=False)]
    forced = 4242
    assert all(forced not in f for f in free)
    banned = {t: -100.0 for t in free[2]}
    params = [greedy(6, logit_bias={forced: 100.0}), greedy(6), greedy(6, logit_bias=banned)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == [forced] * 6
    assert outs[1].outputs[0].token_ids == free[1], "a row without a bias is untouched by its neighbours'"
    assert not set(outs[2].outputs[0].token_ids) & set(banned)
    # sampled rows too (the bias is added before temperature and top-k/p)
    [s] = llm.generate([prompts[0]], SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True, logit_bias={forced: 100.0}),
                       use_tqdm=False)
    assert s.outputs[0].token_ids == [forced] * 8


def test_logit_bias_leaves_the_reported_logprobs_raw(llm):
    """vLLM's default: logprobs are the model's, before any processing."""
    p = [5, 6, 7, 8]
    [free] = llm.generate([p], greedy(1, logprobs=5), use_tqdm=False)
    [bias] = llm.generate([p], greedy(1, logprobs=5, logit_bias={4242: 100.0}), use_tqdm=False)
    f, b = free.outputs[0], bias.outputs[0]
    assert b.token_ids == [4242] and f.token_ids != [4242]
    top = {k: v.logprob for k, v in f.logprobs[0].items() if v.rank <= 5}
    assert {k: v.logprob for k, v in b.logprobs[0].items() if v.rank <= 5} == pytest.approx(top)
    assert b.logprobs[0][4242].rank > 5


def _bigram_run(tiny_model_dir, requests, speculative_config):
    e = engine(tiny_model_dir, speculative_config=speculative_config)
    Bigram(e)
    for rid, pr, params in requests:
        e.add_request(rid, pr, params)
    done = run(e)
    assert e.stats()["kv_blocks_used"] == 0
    return {rid: [(s.output_token_ids, s.finish_reason) for s in r.seqs] for rid, r in done.items()}


def test_logit_bias_under_speculative_decoding(tiny_model_dir):
    """Verification samples every draft position with the request's bias: the outputs equal
    those without speculation (greedy, seeded, forks), and the bias changed them."""
    rng = random.Random(5)
    requests, unbiased = [], []
    for i in range(6):
        bias = {BASE + rng.randrange(N): rng.choice([-8.0, 4.0, 6.0]) for _ in range(4)}
        kw = dict(max_tokens=30, ignore_eos=True, n=2 if i == 5 else 1)
        if i % 2:
            kw.update(temperature=0.8, seed=i)
        else:
            kw.update(temperature=0)
        pr = prompt(rng, rng.randint(6, 30))
        requests.append((f"r{i}", pr, SamplingParams(logit_bias=bias, **kw)))
        unbiased.append((f"r{i}", pr, SamplingParams(**kw)))
    off = _bigram_run(tiny_model_dir, requests, None)
    on = _bigram_run(tiny_model_dir, requests, spec(4))
    assert on == off
    assert _bigram_run(tiny_model_dir, unbiased, None) != off, "the bias must change something"


def test_logit_bias_cannot_break_the_grammar(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_memory=64 * BLOCK_BYTES_TINY)
    tok = llm.get_tokenizer()
    choices = ["yes", "no"]
    first = {c: tok.encode(c)[0] for c in choices}
    so = StructuredOutputsParams(choice=choices)
    for pick in choices:
        [o] = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, structured_outputs=so, logit_bias={first[pick]: 50.0}),
                           use_tqdm=False)
        assert o.outputs[0].text == pick
    # a token the grammar forbids stays forbidden, however large its bias
    [o] = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, structured_outputs=so, logit_bias={4242: 1e6}),
                       use_tqdm=False)
    assert o.outputs[0].text in choices and 4242 not in o.outputs[0].token_ids


def test_a_replaced_logit_bias_is_the_one_applied(llm):
    """The sampler caches the bias as tensors per SamplingParams; admission rebuilds them, so a
    caller that reuses its params with a new dict gets the new bias."""
    p = greedy(3, logit_bias={4242: 100.0})
    assert llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].outputs[0].token_ids == [4242] * 3
    p.logit_bias = {777: 100.0}
    assert llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].outputs[0].token_ids == [777] * 3
