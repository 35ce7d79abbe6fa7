"""Prompt-lookup drafts: find the sequence's last n tokens earlier in its prompt or output and
propose the tokens that followed them there.

``NgramIndex`` maps every n-gram (``n_min <= n <= n_max``) of a sequence's tokens to the end of
its latest occurrence, so a proposal costs ``n_max - n_min + 1`` dict lookups instead of a scan
of the whole context. It is built lazily and only ever extended: a sequence's ``token_ids`` hold
accepted tokens only and never shrink (drafts live in the schedule, never in ``token_ids``), so
an entry once made stays true.

Invariant: after ``_extend(tokens)``, the index holds every n-gram ending at an index ``e <
len(tokens)`` (end exclusive), i.e. every occurrence but the suffix itself, so a hit ``e`` always
leaves ``tokens[e:]`` non-empty to propose from. The latest occurrence is preferred: in a copying
output it tracks where in the source the copy has got to. A proposal that runs into the end of the
context continues with itself (``_follow``): an occurrence ``p`` tokens back means the text repeats
with period ``p``, so the draft repeats it too instead of stopping after ``p`` tokens.
"""

from __future__ import annotations


class NgramIndex:
    __slots__ = ("n_min", "n_max", "maps", "upto")

    def __init__(self, n_min: int, n_max: int):
        self.n_min = n_min
        self.n_max = n_max
        self.maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max - n_min + 1)]
        self.upto = 0  # n-grams ending (exclusive) at 1..upto are indexed

    def _extend(self, tokens: list[int]) -> None:
        end = len(tokens) - 1  # the suffix (ending at len(tokens)) is what we look up
        lo, maps = self.n_min, self.maps
        for e in range(self.upto + 1, end + 1):
            for j, m in enumerate(maps):
                n = lo + j
                if e >= n:
                    m[tuple(tokens[e - n : e])] = e
        self.upto = max(self.upto, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest matching suffix n-gram; [] without a match."""
        if k <= 0 or len(tokens) < self.n_min + 1:
            return []
        self._extend(tokens)
        L = len(tokens)
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            e = self.maps[n - self.n_min].get(tuple(tokens[L - n :]))
            if e is not None:
                return _follow(tokens, e, k)
        return []


def _follow(tokens: list[int], e: int, k: int) -> list[int]:
    """``k`` tokens from ``e`` on, reading the proposal itself past the end of ``tokens``."""
    L = len(tokens)
    if e + k <= L:
        return tokens[e : e + k]
    out = tokens[e:]
    while len(out) < k:
        out.append(out[len(out) - (L - e)])
    return out


def propose(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """One-off proposal without an index (the reference the index is tested against): the latest
    earlier occurrence of the longest suffix n-gram, ``n_max`` down to ``n_min``."""
    L = len(tokens)
    if k <= 0:
        return []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n :]
        for e in range(L - 1, n - 1, -1):
            if tokens[e - n : e] == suffix:
                return _follow(tokens, e, k)
    return []
