"""The demo's live table, then its summary: the summary's title is a line of its own, never drawn
on the live table's bottom border (which happened whenever the output was not a terminal)."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from qworker.demo import live_view, render, summary

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
FINAL = {
    "a": {"type": "completion", "status": "ok", "timings": {"ttft_s": 0.1, "total_s": 1.0}, "choices": [{"finish_reason": "stop"}],
          "usage": {"completion_tokens": 10, "cached_tokens": 3}},
    "b": {"type": "error", "error": {"code": "invalid_job", "message": "sampling.max_tokens: too small"}},
}


@pytest.mark.parametrize("terminal", [False, True], ids=["pipe", "terminal"])
def test_summary_title_is_on_its_own_line(terminal: bool) -> None:
    out = io.StringIO()
    console = Console(file=out, width=100, height=40, force_terminal=terminal, color_system=None)
    jobs = ["a", "b", "c"]
    with live_view(console, render(jobs, {}, {})) as live:
        live.update(render(jobs, {"a": "hello there"}, FINAL))
    console.print(summary(jobs, FINAL))
    lines = ANSI.sub("", out.getvalue()).replace("\r", "\n").splitlines()
    titled = [ln for ln in lines if "summary" in ln]
    assert [ln.strip() for ln in titled] == ["summary"], titled
    at = lines.index(titled[0])
    assert lines[at - 1].strip().startswith("└") and lines[at - 1].strip().endswith("┘")  # the live table ended above it
    assert lines[at + 1].strip().startswith("┏")  # and the summary table starts below it
