"""Incremental detokenization never splits a UTF-8 character; stop strings are held back."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from qworker.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


SAMPLES = ["naïve café — 東京タワー 🚀🎉 ok", "Ünïcödé ✓ ∑ x² 😀 done", "plain ascii words, then émojis 🧪🧬 and 中文字符"]


@pytest.mark.parametrize("text", SAMPLES)
def test_streamed_text_equals_full_decode_and_is_never_broken(tok, text):
    prompt = tok.encode("Say:")
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt, stop=[])
    seen = []
    for t in ids:
        d.append(t)
        assert "\ufffd" not in d.text
        seen.append(d.text)
    assert d.text == tok.decode(ids)
    assert all(a == b[: len(a)] for a, b in zip(seen, seen[1:])), "text only grows"


def test_stop_string_across_tokens_is_cut_and_held_back(tok):
    rng = random.Random()
    stop = "STOP here"
    pre = "alpha beta gamma " * rng.randrange(1, 4)
    ids = tok.encode(pre + stop + " tail words")
    d = IncrementalDetokenizer(tok, [], stop=[stop])
    shown = ""
    found = None
    for t in ids:
        found = d.append(t)
        if found:
            break
        shown = d.text[: d.stable_length()]
        # what a stream shows is always a prefix of the final text: a started stop string is held back
        assert pre.startswith(shown), (shown, pre)
    assert found == stop
    assert d.text == pre
