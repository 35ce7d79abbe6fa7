"""Benchmark workloads drawn with fixed seeds from real English text every Debian system ships
(the licence texts in /usr/share/common-licenses; Python's own LICENSE as a fallback)."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

LICENCE_DIR = Path("/usr/share/common-licenses")


@dataclass
class Item:
    prompt_ids: list[int]
    max_tokens: int
    n: int = 1
    group: str = ""  # e.g. "short"/"long" in head-of-line, the prefix group in shared-prefix


def corpus_text() -> str:
    parts = []
    for name in ("GPL-3", "Apache-2.0", "LGPL-3", "GFDL-1.3", "Artistic", "MPL-2.0"):
        p = LICENCE_DIR / name
        if p.exists():
            parts.append(p.read_text(errors="ignore"))
    if not parts:  # not Debian: the text CPython ships with itself
        parts.append((Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "LICENSE.txt").read_text())
    return "\n".join(" ".join(p.split()) for p in parts)


def corpus_ids(tokenizer) -> list[int]:
    return tokenizer.encode(corpus_text())


def _slice(ids: list[int], rng: random.Random, n: int) -> list[int]:
    start = rng.randrange(0, len(ids) - n)
    return ids[start : start + n]


def mixed(tokenizer, num: int = 128, seed: int = 0, prompt_range=(16, 256), output_range=(32, 256)) -> list[Item]:
    """Wide spread of prompt and output lengths (ShareGPT-like); outputs ignore EOS."""
    rng = random.Random(seed)
    ids = corpus_ids(tokenizer)
    return [Item(_slice(ids, rng, rng.randint(*prompt_range)), rng.randint(*output_range)) for _ in range(num)]


def shared_prefix(tokenizer, groups: int = 4, per_group: int = 8, prefix_len: int = 384, seed: int = 0, max_tokens: int = 16) -> list[Item]:
    """Groups of requests sharing a long system prompt, each with a short distinct question."""
    rng = random.Random(seed)
    ids = corpus_ids(tokenizer)
    items = []
    for g in range(groups):
        system = _slice(ids, rng, prefix_len)
        for _ in range(per_group):
            items.append(Item(system + _slice(ids, rng, rng.randint(8, 24)), max_tokens, group=f"g{g}"))
    rng.shuffle(items)
    return items


def long_context(tokenizer, num: int = 6, context: int = 2048, seed: int = 0, max_tokens: int = 64) -> list[Item]:
    rng = random.Random(seed)
    ids = corpus_ids(tokenizer)
    return [Item(_slice(ids, rng, context - max_tokens - rng.randint(0, 64)), max_tokens) for _ in range(num)]


def parallel_sampling(tokenizer, num: int = 16, n: int = 4, seed: int = 0) -> list[Item]:
    rng = random.Random(seed)
    ids = corpus_ids(tokenizer)
    return [Item(_slice(ids, rng, rng.randint(32, 160)), rng.randint(32, 96), n=n) for _ in range(num)]


def head_of_line(tokenizer, num_long: int = 3, num_short: int = 24, seed: int = 0) -> list[Item]:
    """A few very long jobs (long prompts and outputs) first, short ones behind them."""
    rng = random.Random(seed)
    ids = corpus_ids(tokenizer)
    longs = [Item(_slice(ids, rng, 1024), 384, group="long") for _ in range(num_long)]
    shorts = [Item(_slice(ids, rng, rng.randint(16, 48)), rng.randint(8, 24), group="short") for _ in range(num_short)]
    return longs + shorts
