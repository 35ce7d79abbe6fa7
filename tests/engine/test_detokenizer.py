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


def test_fast_decode_path_gives_the_wrapper_text(tok):
    """The Rust-backend window decode (and its one-token memo) equals transformers' decode on
    random windows of random ids, special tokens included, with and without skipping them."""
    from qworker.engine.detokenizer import decoder_for

    rng = random.Random()
    specials = list(tok.all_special_ids)
    for skip in (True, False):
        dec = decoder_for(tok, skip)
        assert decoder_for(tok, skip) is dec, "one shared decoder per tokenizer and setting"
        for _ in range(400):
            ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randrange(0, 7))]
            assert dec(ids) == tok.decode(ids, skip_special_tokens=skip), ids
            assert dec(ids) == tok.decode(ids, skip_special_tokens=skip), "memo returns the same"


def test_streamed_text_equals_full_decode_without_the_fast_path(tok):
    """A tokenizer the fast path cannot take (its wrapper cleans up spaces) still streams the
    text its own decode gives."""
    import copy

    slow = copy.deepcopy(tok)
    slow.clean_up_tokenization_spaces = True
    ids = tok.encode("Hello , world ! It 's fine . " + SAMPLES[0])
    d = IncrementalDetokenizer(slow, [], stop=[])
    for t in ids:
        d.append(t)
    d.flush()
    assert d.text == slow.decode(ids)


def _held_back_by_trying_every_prefix(text: str, stops: list[str]) -> int:
    """The holdback by definition: the longest proper prefix of a stop string the text ends with."""
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])), default=0)


def test_the_held_back_tail_follows_the_definition_as_the_text_grows_and_forks() -> None:
    """helper-120: the holdback tried every prefix of every stop string at every token
    (O(len(stop)^2): 16 stop strings of 1,000 characters cost ~1.2 ms per sequence per token, on
    the thread every request waits on). It is now a KMP match kept as the text grows; here it is
    checked against the definition over random texts on a small alphabet (many partial matches,
    whole stop strings inside the text, a fork taken midway, a text cut at a stop)."""

    from qworker.engine.detokenizer import _StopTails

    rng = random.Random(7)
    for trial in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 7))) for _ in range(rng.randint(1, 4))]
        tails, text, fork, fork_text = _StopTails(stops), "", None, ""
        for step in range(rng.randint(1, 12)):
            text += "".join(rng.choice("abc") for _ in range(rng.randint(0, 4)))
            assert tails.hold(text) == _held_back_by_trying_every_prefix(text, stops), (stops, text)
            if step == 3:
                fork, fork_text = tails.copy(), text
        if fork is not None:  # the fork goes on with text of its own; the original is not disturbed
            fork_text += "ab"
            assert fork.hold(fork_text) == _held_back_by_trying_every_prefix(fork_text, stops)
        cut = text[: rng.randint(0, len(text))]
        assert tails.hold(cut) == _held_back_by_trying_every_prefix(cut, stops), (stops, cut)
    assert _StopTails(["q" * 999 + "x"] * 16).hold("q" * 5000) == 999  # long, repetitive: still linear
