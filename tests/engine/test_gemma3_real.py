"""The real Gemma 3 270M (``make model-gemma3``) against transformers (fp32, eager) on prompts of
600-900 tokens, past its 512-token sliding window (15 of its 18 layers slide; local rope base
1e4, global 1e6). Opt-in and slow: ``QWORKER_TEST_GEMMA3=1``; the folder is
``$QWORKER_GEMMA3_MODEL`` or ``models/gemma3-270m``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from qworker import LLM, SamplingParams
from tests.engine.family_reference import eager_greedy
from tests.engine.hf_reference import assert_greedy_matches

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 24

pytestmark = pytest.mark.skipif(os.environ.get("QWORKER_TEST_GEMMA3") != "1",
                                reason="slow, opt-in: QWORKER_TEST_GEMMA3=1 (after `make model-gemma3`)")


@pytest.fixture(scope="module")
def gemma3_dir() -> Path:
    path = Path(os.environ.get("QWORKER_GEMMA3_MODEL", ROOT / "models" / "gemma3-270m"))
    if not (path / "config.json").exists():
        pytest.fail(f"Gemma 3 270M missing at {path}: run `make model-gemma3`")
    return path


def long_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Real text (this repository's README and design notes), cut to each length in tokens."""
    text = "\n\n".join(p.read_text() for p in (ROOT / "README.md", ROOT / "docs" / "benchmarks.md") if p.exists())
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 2 * max(lengths), "not enough text for the prompts"
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + ids[start : start + n - len(bos)] for start, n in zip((0, 700, 1500), lengths)]


def test_gemma3_270m_greedy_matches_transformers_past_the_window(gemma3_dir):
    llm = LLM(str(gemma3_dir), dtype="float32", kv_cache_memory=256 << 20, max_model_len=2048)
    prompts = long_prompts(llm.tokenizer, [600, 750, 900])
    assert all(len(p) > 512 for p in prompts)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert_greedy_matches(o.outputs[0].token_ids, eager_greedy(gemma3_dir, p, MAX_TOKENS), f"gemma3 270m, prompt of {len(p)}")
