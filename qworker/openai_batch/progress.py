"""A one-line progress indicator on stderr (no dependency): redrawn in place on a terminal,
a plain line every few seconds otherwise (logs, CI), and always a last line with the totals."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, every_s: float = 5.0):
        self.label, self.total = label, total
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = 0.1 if self.tty else every_s
        self.started = time.monotonic()
        self._last = 0.0
        self._finished = False  # the 100% line is drawn once
        self.done = 0

    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def line(self, extra: str = "") -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return f"{self.label} {self.done}/{self.total} ({pct:.0f}%) {self.rate():.1f}/s{extra}"

    def update(self, done: int, extra: str = "") -> None:
        self.done = done
        now = time.monotonic()
        if (now - self._last < self.every_s and done < self.total) or self._finished:
            return
        self._last, self._finished = now, done >= self.total
        self.stream.write(("\r\x1b[K" if self.tty else "") + self.line(extra) + ("" if self.tty else "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
