"""Llama 4 beyond what every family runs (tests/engine/test_model_families.py checks its tokens
against transformers): its rotary layers' chunked attention is served within one chunk, so the
context is lowered to ``attention_chunk_size`` with a warning, and a prompt past it is refused as
too long rather than served with the wrong mask."""

from __future__ import annotations

import logging

import pytest

from qworker import LLM, SamplingParams
from qworker.engine.errors import InvalidRequestError
from qworker.model.runner import ModelRunner
from tests.engine.family_models import build_family_model
from tests.engine.family_reference import eager_greedy
from tests.engine.hf_reference import assert_greedy_matches


@pytest.fixture(scope="module")
def chunked(tmp_path_factory, model_dir):
    return build_family_model("llama4_text", tmp_path_factory.mktemp("llama4") / "m", model_dir, attention_chunk_size=48)


def test_the_context_is_one_attention_chunk(chunked, caplog):
    assert ModelRunner(chunked, device="cpu", dtype="float32").max_model_len == 48
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner(chunked, device="cpu", dtype="float32", max_model_len=1024)
    assert runner.max_model_len == 48
    assert "Llama 4's chunked attention is served within its first chunk only" in caplog.text


def test_within_the_chunk_it_matches_transformers_and_past_it_jobs_are_refused(chunked):
    llm = LLM(str(chunked), dtype="float32", kv_cache_memory=8 << 20)
    fits, too_long = list(range(100, 130)), list(range(100, 160))
    out = llm.generate([fits], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
    assert_greedy_matches(out.outputs[0].token_ids, eager_greedy(chunked, fits, 16), "llama4 within its chunk")
    with pytest.raises(InvalidRequestError, match="the prompt has 60 tokens; at most 47 fit"):
        llm.generate([too_long], SamplingParams(temperature=0, max_tokens=4))
