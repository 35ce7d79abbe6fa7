"""Incremental detokenization and stop strings.

Text is decoded over a small sliding window of tokens so that a multi-byte character split
across tokens is never emitted half-done (a window that ends in U+FFFD waits for more tokens),
and so that tokenizers which drop a leading space when decoding a lone token still space words.
Stop strings are found in the text as it grows; while streaming, a tail that could still become
a stop string is held back. When the output ends, a character still incomplete is emitted as the
replacement character, as a plain ``decode`` of the output would.

Speed: every generated token costs two window decodes. Through transformers' Python wrapper a
decode costs ~9 us; the Rust backend's own ``decode`` gives the same text (when the wrapper adds
no clean-up) in ~4 us, and the first window is usually one token, whose text is cached per
tokenizer. ``decoder_for`` picks the path once per tokenizer.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable

REPLACEMENT = "\ufffd"

Decode = Callable[[list[int]], str]
_decoders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _direct_backend(tokenizer):
    """The Rust ``tokenizers.Tokenizer`` behind a fast HF tokenizer when decoding through it
    directly gives the wrapper's text: the wrapper's only extra step is the optional clean-up of
    spaces before punctuation, so that must be off."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode") or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


class _Decoder:
    """Window decodes for one tokenizer and ``skip_special_tokens`` setting. One-token windows are
    memoised (a decode is a pure function of its ids; at most one entry per vocabulary id)."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        backend = _direct_backend(tokenizer)
        if backend is not None:
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        self._single: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> str:
        if len(ids) == 1:
            text = self._single.get(ids[0])
            if text is None:
                text = self._single[ids[0]] = self._decode(ids)
            return text
        return self._decode(ids)


def decoder_for(tokenizer, skip_special_tokens: bool) -> Decode:
    """The window decoder of ``tokenizer``: shared per tokenizer on the direct path (it holds
    only the Rust backend, so the weak cache entry goes with the tokenizer), else a fresh one."""
    if _direct_backend(tokenizer) is None:
        return _Decoder(tokenizer, skip_special_tokens)
    try:
        pair = _decoders.get(tokenizer)
    except TypeError:  # not weak-referenceable: no sharing, still correct
        return _Decoder(tokenizer, skip_special_tokens)
    if pair is None:
        pair = _decoders[tokenizer] = {}
    dec = pair.get(skip_special_tokens)
    if dec is None:
        dec = pair[skip_special_tokens] = _Decoder(tokenizer, skip_special_tokens)
    return dec


@functools.lru_cache(maxsize=4096)
def _borders(s: str) -> tuple[int, ...]:
    """KMP's prefix function: [i] = the length of the longest proper prefix of ``s[:i + 1]`` that
    is also its suffix."""
    f, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return tuple(f)


class _StopTails:
    """For each stop string, the longest proper prefix of it that the text ends with (the tail a
    stream holds back), kept as the text grows: KMP's matcher fed each new character once. Trying
    every prefix of every stop string instead cost O(len(stop)^2) per token: with 16 stop strings
    of 1,000 characters, ~1.2 ms per sequence per token on the engine's thread, which every other
    request waited on."""

    __slots__ = ("stops", "borders", "states", "fed")

    def __init__(self, stops: list[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]
        self.borders = [_borders(s) for s in self.stops]
        self.states = [0] * len(self.stops)
        self.fed = 0  # characters of the text matched so far

    def copy(self) -> _StopTails:
        other = object.__new__(_StopTails)
        other.stops, other.borders, other.states, other.fed = self.stops, self.borders, list(self.states), self.fed
        return other

    def hold(self, text: str) -> int:
        """The longest of those prefixes for ``text`` (which grew since the last call, or was cut)."""
        if len(text) < self.fed:  # cut: a proper prefix is shorter than its stop, so its tail decides
            self.states = [0] * len(self.stops)
            self.fed = max(0, len(text) - max(map(len, self.stops), default=0))
        new, self.fed = text[self.fed:], len(text)
        hold = 0
        for j, s in enumerate(self.stops):
            f, k, m = self.borders[j], self.states[j], len(s)
            for c in new:
                while k and c != s[k]:
                    k = f[k - 1]
                if c == s[k]:
                    k += 1
                    if k == m:  # the whole stop string (not searched before min_tokens): its longest border
                        k = f[m - 1]
            self.states[j] = k
            hold = max(hold, k)
        return hold


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop  # a matched stop string stays in the text
        self._decode = decoder_for(tokenizer, skip_special_tokens)
        self.ids: list[int] = list(prompt_token_ids[-6:])  # context for spacing
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self._tails: _StopTails | None = None  # made on the first stable_length

    def clone(self) -> IncrementalDetokenizer:
        other = object.__new__(IncrementalDetokenizer)
        other.tokenizer = self.tokenizer
        other.skip_special_tokens = self.skip_special_tokens
        other.stop = self.stop
        other.include_stop = self.include_stop
        other._decode = self._decode
        other.ids = list(self.ids)
        other.prefix_offset = self.prefix_offset
        other.read_offset = self.read_offset
        other.text = self.text
        other._tails = self._tails.copy() if self._tails is not None else None
        return other

    def append(self, token_id: int, find_stop: bool = True) -> str | None:
        """Adds a token; returns the stop string if the text now contains one (the text is then
        cut just before it, or just after it with ``include_stop``). ``find_stop`` False (before
        ``min_tokens``) skips the search; a later search starts from the new text, as vLLM's."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return None  # an incomplete character: wait for the next token
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        old_len = len(self.text)
        self.text += delta
        return self._find_stop(old_len) if find_stop and self.stop else None

    def flush(self) -> None:
        """The output ended: emit what an incomplete character held back (as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text):
            self.text += new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.ids)

    def _find_stop(self, old_len: int) -> str | None:
        """The earliest stop string that ends in the text added after ``old_len``: each is searched
        from where it could first end there (a stop string that lay wholly in older text was
        either searched already or, before ``min_tokens``, is not one)."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(old_len - len(s) + 1, 0))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0] + (len(best[1]) if self.include_stop else 0)]
        return best[1]

    def stable_length(self) -> int:
        """How much of the text can be shown while streaming: all but a tail that is a proper
        prefix of some stop string."""
        if not self.stop:
            return len(self.text)
        if self._tails is None:
            self._tails = _StopTails(self.stop)
        return len(self.text) - self._tails.hold(self.text)
