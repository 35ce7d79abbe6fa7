"""bench/kv_huge_pages.py, small: both pools are timed (the figures are for an idle machine)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import kv_huge_pages  # noqa: E402


def test_kv_huge_pages_small_run(capsys):
    med = kv_huge_pages.main(["--batch", "2", "--context", "40", "--blocks", "64", "--layers", "2", "--rounds", "2", "--threads", "1"])
    assert set(med) == {"4k", "huge"} and all(t > 0 for t in med.values())
    assert "huge / 4 KiB" in capsys.readouterr().out
