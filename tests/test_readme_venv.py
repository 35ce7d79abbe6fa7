"""A local user's ``qworker …`` commands in the README are found: ``make`` installs qworker into
``.venv`` (not onto the PATH), so every block that runs ``qworker`` on the user's machine
activates the venv first or calls ``.venv/bin/qworker``."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
ACTIVATE = re.compile(r"^\s*(?:\.|source)\s+\.venv/bin/activate\b")
ENV_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")


def shell_blocks(text: str) -> list[list[str]]:
    """The lines of every fenced block that is shell (```bash, ```sh or an untagged fence)."""
    blocks, cur, inside = [], None, False
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and not inside:
            inside, cur = True, [] if fence.group(1) in ("", "bash", "sh", "console") else None
        elif fence and inside:
            inside = False
            if cur is not None:
                blocks.append(cur)
        elif inside and cur is not None:
            cur.append(line)
    return blocks


def runs_local_qworker(line: str) -> bool:
    cmd = ENV_PREFIX.sub("", line.split("#", 1)[0].strip())
    return cmd.startswith("qworker ")


def test_the_setup_says_where_qworker_is_installed() -> None:
    setup = README.split("\n## ", 2)[1]  # the section after the title: the two commands
    assert ".venv/bin/activate" in setup and ".venv/bin/qworker" in setup


def test_every_local_qworker_command_has_the_venv() -> None:
    checked = 0
    for block in shell_blocks(README):
        active = False
        for line in block:
            if ACTIVATE.match(line):
                active = True
            if runs_local_qworker(line):
                checked += 1
                assert active, f"`{line.strip()}` runs qworker without activating .venv first (block: {block[:3]})"
            assert not line.lstrip().startswith("/usr/local/bin/qworker")
    assert checked >= 10  # the batch walkthrough, the CLI listing and the topics step
