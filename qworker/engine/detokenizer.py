"""Incremental detokenization and stop strings.

Text is decoded over a small sliding window of tokens so that a multi-byte character split
across tokens is never emitted half-done (a window that ends in U+FFFD waits for more tokens),
and so that tokenizers which drop a leading space when decoding a lone token still space words.
Stop strings are found in the text as it grows; while streaming, a tail that could still become
a stop string is held back. When the output ends, a character still incomplete is emitted as the
replacement character, as a plain ``decode`` of the output would.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop  # a matched stop string stays in the text
        self.ids: list[int] = list(prompt_token_ids[-6:])  # context for spacing
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def clone(self) -> IncrementalDetokenizer:
        other = object.__new__(IncrementalDetokenizer)
        other.tokenizer = self.tokenizer
        other.skip_special_tokens = self.skip_special_tokens
        other.stop = self.stop
        other.include_stop = self.include_stop
        other.ids = list(self.ids)
        other.prefix_offset = self.prefix_offset
        other.read_offset = self.read_offset
        other.text = self.text
        return other

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

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
        start = max(len(self.text) - max((len(s) for s in self.stop), default=0) + 1, 0)
        self.text += delta
        return self._find_stop(start) if find_stop and self.stop else None

    def flush(self) -> None:
        """The output ended: emit what an incomplete character held back (as U+FFFD)."""
        if self.read_offset == len(self.ids):
            return
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text):
            self.text += new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.ids)

    def _find_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0] + (len(best[1]) if self.include_stop else 0)]
        return best[1]

    def stable_length(self) -> int:
        """How much of the text can be shown while streaming: all but a tail that is a proper
        prefix of some stop string."""
        n = len(self.text)
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, n), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return n - hold
