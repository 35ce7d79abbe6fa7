"""Prompt-lookup drafts: find the sequence's last n tokens earlier in its prompt or output and
propose the tokens that followed them there.

``NgramIndex`` lists the occurrences of every ``n_min``-gram of a sequence's tokens, so a proposal
compares only at the occurrences of its last ``n_min`` tokens instead of scanning the whole
context (and the index is one entry per token whatever ``n_max``). It is built lazily and only ever extended: a sequence's ``token_ids`` hold
accepted tokens only and never shrink (drafts live in the schedule, never in ``token_ids``), so
an entry once made stays true.

Invariant: after ``_extend(tokens)``, the index holds every ``n_min``-gram ending at an index ``e <
len(tokens)`` (end exclusive), i.e. every occurrence but the suffix itself, so a hit ``e`` always
leaves ``tokens[e:]`` non-empty to propose from. The latest occurrence is preferred: in a copying
output it tracks where in the source the copy has got to. A proposal that runs into the end of the
context continues with itself (``_follow``): an occurrence ``p`` tokens back means the text repeats
with period ``p``, so the draft repeats it too instead of stopping after ``p`` tokens.
"""

from __future__ import annotations


class NgramIndex:
    """Occurrences of every ``n_min``-gram, by the end (exclusive) of each, in increasing order.

    Only ``n_min``-grams are indexed: a suffix that matches at length ``n`` matches at ``n_min``
    too, so the candidates for every ``n`` are the occurrences of the last ``n_min`` tokens, and
    each one's match length is found by comparing backwards (at most ``n_max`` tokens, scanning
    the latest first and stopping at the first that reaches the longest possible length). An
    index of every ``n`` in ``n_min .. n_max`` held ``n_max - n_min + 1`` tuples per token: with
    the allowed 1..64, a 4,000-token prompt cost ~1.1 s and ~80 MiB per sequence on first use."""

    __slots__ = ("n_min", "n_max", "occ", "upto")

    def __init__(self, n_min: int, n_max: int):
        self.n_min = n_min
        self.n_max = n_max
        self.occ: dict[tuple[int, ...], list[int]] = {}
        self.upto = 0  # n_min-grams ending (exclusive) at 1..upto are indexed

    def _extend(self, tokens: list[int]) -> None:
        end = len(tokens) - 1  # the suffix (ending at len(tokens)) is what we look up
        n, occ = self.n_min, self.occ
        for e in range(max(self.upto + 1, n), end + 1):
            key = tuple(tokens[e - n : e])
            lst = occ.get(key)
            if lst is None:
                occ[key] = [e]
            else:
                lst.append(e)
        self.upto = max(self.upto, end)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest matching suffix n-gram; [] without a match."""
        if k <= 0 or len(tokens) < self.n_min + 1:
            return []
        self._extend(tokens)
        L = len(tokens)
        cands = self.occ.get(tuple(tokens[L - self.n_min :]))
        if not cands:
            return []
        longest = min(self.n_max, L - 1)
        best_e, best_n = -1, 0
        for idx in range(len(cands) - 1, -1, -1):
            e = cands[idx]
            m = self.n_min
            lim = min(longest, e)
            while m < lim and tokens[e - m - 1] == tokens[L - m - 1]:
                m += 1
            if m > best_n:
                best_e, best_n = e, m
                if m == longest:
                    break
        return _follow(tokens, best_e, k)


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
