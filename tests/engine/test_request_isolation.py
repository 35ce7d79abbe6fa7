"""One request's bad state must end that request alone (helper-109): a caller that changes its
``SamplingParams`` after submitting, a boolean option given as something else, and any failure
while a request's sampled tokens are recorded (detokenizer, stop checks)."""

from __future__ import annotations

import random

import pytest

from qworker import InvalidRequestError
from qworker.engine import SamplingParams
from tests.engine.engine_support import engine, greedy, outputs, rand_ids, run


@pytest.mark.parametrize("field", ["skip_special_tokens", "ignore_eos", "include_stop_str_in_output"])
def test_boolean_options_must_be_booleans(tiny_model_dir, field):
    e = engine(tiny_model_dir)
    for value in (None, "no", 1):
        with pytest.raises(InvalidRequestError, match=field):
            SamplingParams(**{field: value})
        params = greedy(4)
        setattr(params, field, value)  # set after construction: the engine's door checks again
        with pytest.raises(InvalidRequestError, match=field):
            e.add_request("bad", [5, 6, 7], params)
    assert not e.has_unfinished()


def test_changing_params_after_submitting_does_not_reach_the_running_request(tiny_model_dir):
    """vLLM clones the parameters at admission: the caller may reuse its object for the next
    request with other values (max_tokens=None crashed the running request's stop check)."""
    rng = random.Random(1)
    prompt = rand_ids(rng, 12)
    e = engine(tiny_model_dir)
    params = greedy(12, stop=["never-in-this-output"])
    e.add_request("a", prompt, params)
    e.step()
    params.max_tokens, params.temperature, params.min_tokens = None, 1.0, 3
    params.stop.append("x")
    e.add_request("b", prompt, params)
    done = run(e)
    a = done["a"]
    assert a.error_code is None and a.seqs[0].finish_reason == "length" and a.seqs[0].num_output_tokens == 12
    assert a.params.max_tokens == 12 and a.params.stop == ["never-in-this-output"] and a.params.temperature == 0
    assert done["b"].error_code is None


def test_a_request_whose_tokens_cannot_be_recorded_fails_alone(tiny_model_dir):
    rng = random.Random(2)
    p1, p2 = rand_ids(rng, 20), rand_ids(rng, 9)
    want = outputs(run(_with(engine(tiny_model_dir, enable_prefix_caching=False), "good", p2))["good"])
    e = engine(tiny_model_dir, enable_prefix_caching=False)
    _with(e, "broken", p1, n=2)
    _with(e, "good", p2)
    e.step()  # both prefilled, first tokens recorded

    class Broken:
        def append(self, *a, **k):
            raise RuntimeError("tokenizer rejects this request's options")

        def flush(self):
            raise RuntimeError("still broken")

    for seq in e.requests["broken"].seqs:
        seq.detokenizer = Broken()
    done = run(e)
    broken = done["broken"]
    assert broken.error_code == "engine_error" and "tokenizer rejects" in broken.error
    assert all(s.finish_reason == "abort" for s in broken.seqs)
    assert done["good"].error_code is None and outputs(done["good"]) == want
    assert e.stats()["kv_blocks_used"] == 0 and e.stats()["requests_failed"] == 1


def _with(e, request_id, prompt, n=1):
    e.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=n))
    return e
