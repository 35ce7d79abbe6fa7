"""When speculation pays: a learned step-cost curve against the measured acceptance.

A verification step of ``B`` decoding sequences with drafts of lengths ``L_i`` (capped at ``c``)
runs ``T = B + sum(min(L_i, c))`` rows; it is expected to yield ``B + sum(E[a_i])`` tokens, where
``E[a]`` for a draft of length ``L`` is ``sum_{j<=L} prod_{i<=j} r_i`` with ``r_i`` the measured
rate at which draft position ``i`` is accepted once reached (Beta(1, 1) prior). Speculating with
cap ``c`` is worth it when ``tokens(c) / cost(T_c) > margin * B / cost(B)``; the cap is chosen
among ``k, k/2, k/4, ..., 1`` and 0 (no drafts).

``cost(T)``: an exponential moving average of measured step seconds per bucket of ``T`` (exact up
to 16 rows, then geometric buckets 25% apart), learned from every step that runs decodes and
verifications only (a prefill chunk would make the row count say nothing about the time).
Between measured buckets it interpolates linearly; below the first, flat; above the last it
assumes time proportional to rows (pessimistic: a GEMM never gets cheaper per row than that at
sizes already compute-bound), so an unmeasured size is never chosen by exploitation alone.
Readings that are no duration (NaN, infinite, negative) are dropped, 0 s is a tiny positive time,
and a bucket's first ``warmup`` readings keep their minimum (a warm-up step is no cost estimate).
The plain-decode baseline of a batch size is re-measured (a step without drafts, in turns with
exploration) until it has ``min_samples`` readings, so one slow first step cannot make drafts look
cheap for good. The optimistic estimate that decides whether a size is worth exploring reads only
buckets with ``min_samples`` readings, so a slow first step of a size does not bar it for good.
Exploration: at most every ``explore_every`` steps, the smallest cap whose row count lies past
the measured range (or in a bucket with fewer than ``min_samples``) is tried if an optimistic
estimate (its cost no higher than the largest measured bucket's) says it could pay. A loss of
one exploratory step per bucket is the price of never assuming a device's cost curve.
"""

from __future__ import annotations

import math

_BUCKET_RATIO = 1.25
MIN_SECONDS = 1e-9  # a step measured as taking no time (coarse clock): no rate divides by zero
_EXACT = 16


def bucket(rows: int) -> int:
    if rows <= _EXACT:
        return rows
    return _EXACT + 1 + int(math.log(rows / _EXACT, _BUCKET_RATIO))


class CostModel:
    """Step seconds as a function of the rows it runs (see the module docstring)."""

    def __init__(self, alpha: float = 0.2, warmup: int = 2):
        self.alpha = alpha
        self.warmup = warmup
        self._buckets: dict[int, list[float]] = {}  # bucket -> [ema rows, ema seconds, samples]

    def observe(self, rows: int, seconds: float) -> None:
        """A step's duration. A reading that is not a finite number >= 0 says nothing and is
        dropped; 0 (a coarse clock) counts as ``MIN_SECONDS`` so no rate divides by zero. Until a
        bucket has ``warmup`` samples it keeps the fastest: a first step of a size can be many
        times slower than the next (allocator, kernel selection, page faults), and an average
        that began there would need dozens of steps to forget it, steps that a bucket no longer
        chosen (the plain-decode baseline once drafts look cheaper) never gets."""
        if rows < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        seconds = max(seconds, MIN_SECONDS)
        b = self._buckets.get(bucket(rows))
        if b is None:
            self._buckets[bucket(rows)] = [float(rows), seconds, 1]
            return
        a = self.alpha
        b[0] += a * (rows - b[0])
        b[1] = min(b[1], seconds) if b[2] < self.warmup else b[1] + a * (seconds - b[1])
        b[2] += 1

    def samples(self, rows: int) -> int:
        b = self._buckets.get(bucket(rows))
        return 0 if b is None else int(b[2])

    @property
    def max_rows(self) -> float:
        return max((b[0] for b in self._buckets.values()), default=0.0)

    def estimate(self, rows: int, optimistic: bool = False, trusted: int = 0) -> float | None:
        """Seconds for a step of ``rows`` rows; None before any measurement. ``trusted``: only
        buckets with at least that many samples count (all, when none has them)."""
        if not self._buckets:
            return None
        pts = sorted((b[0], b[1]) for b in self._buckets.values() if b[2] >= trusted)
        if not pts:
            pts = sorted((b[0], b[1]) for b in self._buckets.values())
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0) if r1 > r0 else t1
        r_last, t_last = pts[-1]
        return t_last if optimistic else t_last * rows / r_last


class AutoPolicy:
    def __init__(self, k: int, margin: float = 1.02, explore_every: int = 16, min_samples: int = 2):
        self.k = k
        self.margin = margin
        self.explore_every = explore_every
        self.min_samples = min_samples
        self.cost = CostModel()
        self.drafted = [0] * k  # per draft position: times reached
        self.accepted = [0] * k  # per draft position: times accepted
        self._since_explore = explore_every
        self._base_explored = False  # the last exploration time measured the baseline
        self.num_explorations = 0
        self.last_cap = 0

    # -- learning ------------------------------------------------------------------------------
    def observe_step(self, rows: int, seconds: float) -> None:
        self.cost.observe(rows, seconds)

    def observe_draft(self, num_draft: int, num_accepted: int) -> None:
        reached = min(num_draft, num_accepted + 1)  # positions past the first rejection were not reached
        for i in range(min(reached, self.k)):
            self.drafted[i] += 1
        for i in range(min(num_accepted, self.k)):
            self.accepted[i] += 1

    def expected_accepted(self, length: int) -> float:
        total, p = 0.0, 1.0
        for i in range(min(length, self.k)):
            p *= (self.accepted[i] + 1) / (self.drafted[i] + 2)
            total += p
        return total

    # -- deciding ------------------------------------------------------------------------------
    def choose_cap(self, num_decodes: int, draft_lens: list[int]) -> int:
        """The draft cap for this step (0: no drafts). ``num_decodes``: decoding sequences that
        will be scheduled (with or without a draft); ``draft_lens``: their drafts' lengths."""
        self._since_explore += 1
        if not draft_lens or num_decodes == 0:
            self.last_cap = 0
            return 0
        base_cost = self.cost.estimate(num_decodes)
        if base_cost is None:  # nothing measured yet: measure plain decode first
            self.last_cap = 0
            return 0
        if (self.cost.samples(num_decodes) < self.min_samples and self._since_explore >= self.explore_every
                and not self._base_explored):
            # the plain-decode baseline is measured (in turns with exploring drafts) until it has
            # min_samples: a baseline read from one slow step would otherwise make every draft
            # look cheap, and no step without drafts would ever come to correct it
            self._since_explore = 0
            self._base_explored = True
            self.last_cap = 0
            return 0
        base_rate = num_decodes / base_cost
        caps = []
        c = self.k
        while c >= 1:
            caps.append(c)
            c //= 2
        caps.sort()
        best, best_rate = 0, base_rate * self.margin
        explore = None
        for c in caps:
            rows = num_decodes + sum(min(n, c) for n in draft_lens)
            tokens = num_decodes + sum(self.expected_accepted(min(n, c)) for n in draft_lens)
            measured = rows <= self.cost.max_rows and self.cost.samples(rows) >= self.min_samples
            est = self.cost.estimate(rows)  # past the measured range: pessimistic
            if tokens / est > best_rate:
                best, best_rate = c, tokens / est
            if not measured and explore is None:
                # not from under-sampled buckets: one slow first step of a size (a kernel compiled
                # for a new shape) would otherwise keep that size from ever being tried again
                opt = self.cost.estimate(rows, optimistic=True, trusted=self.min_samples)
                if tokens / opt > base_rate * self.margin:
                    explore = c
        if explore is not None and explore > best and self._since_explore >= self.explore_every:
            self._since_explore = 0
            self._base_explored = False
            self.num_explorations += 1
            best = explore
        self.last_cap = best
        return best

    def stats(self) -> dict:
        return {"spec_decode_auto_explorations": self.num_explorations, "spec_decode_auto_last_cap": self.last_cap}
