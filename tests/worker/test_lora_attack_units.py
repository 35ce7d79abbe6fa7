"""Attacks on the worker's LoRA names and modules file, without a broker or a model (the adapter
check is a stand-in, as in test_lora_units.py: these tests are about parsing and the table).

Defects found and fixed here: a name ending in a newline passed the name rule (``$`` matches
before a final ``\\n``); a modules text of JSON nested past Python's recursion limit raised
RecursionError out of the parser (a crashed reload round, a traceback at start-up) instead of
being refused as a bad modules file.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from qworker.config import WorkerSettings
from qworker.lora_modules import LoRAModulesError, parse_file_bytes, parse_modules
from qworker.worker.adapters import Adapters
from tests.worker.test_lora_units import adapter_dir

DEEP = "[" * 200_000 + "]" * 200_000



def validate(path: str) -> str:
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter folder {path!r} does not exist")
    return os.path.realpath(path)


@pytest.mark.parametrize("name", ["a\n", "a\r", "a b", "é", "", "a" * 257])
def test_names_outside_the_rule_are_refused(name: str) -> None:
    with pytest.raises(LoRAModulesError, match="adapter name"):
        parse_modules('{"%s": "/x"}' % name.replace("\n", "\\n").replace("\r", "\\r"))


def test_deeply_nested_json_is_a_bad_modules_text(tmp_path: Path) -> None:
    with pytest.raises(LoRAModulesError, match="not a JSON object"):
        parse_modules(DEEP)
    with pytest.raises(LoRAModulesError, match="modules"):
        parse_file_bytes(DEEP.encode(), "modules")
    with pytest.raises(ValidationError):
        WorkerSettings.from_env({"QWORKER_LORA_MODULES": DEEP})


def test_a_modules_file_turned_hostile_keeps_the_last_good_set(tmp_path: Path) -> None:
    a = adapter_dir(tmp_path, "a")
    f = tmp_path / "modules"
    f.write_text(f"a={a}")
    table = Adapters(str(f), validate, "base")
    asyncio.run(table.refresh())
    served = dict(table.served)
    assert list(served) == ["a"]
    for bad in (DEEP, '{"a\\n": "/x"}', "\x00" * 10, "a" * (2 << 20)):
        f.write_text(bad)
        asyncio.run(table.refresh())  # never raises
        assert table.served == served
    assert table.file_errors == 4
    # hostile job names: nothing but model_not_found, the table untouched
    for name in ("../a", "a/..", " a", "a ", "a\n", "á", "A", str(a)):
        for r in (table.resolve(None, name, True), table.resolve(name, None, True)):
            assert r.code == "model_not_found" and r.lora is None
    assert table.resolve(None, "a", True).lora == served["a"]


def test_an_empty_modules_file_after_a_good_one_keeps_the_set_and_braces_empty_it(tmp_path: Path) -> None:
    """helper-79: a file rewritten in place (``echo ... >``, most editors) is empty for a moment;
    read then, it removed every adapter and their jobs failed for good (model_not_found, not
    retryable). An empty file after a non-empty one now keeps the set, counted as a file error;
    ``{}`` serves none; an empty file at the start means no adapters."""
    a = adapter_dir(tmp_path, "a")
    f = tmp_path / "modules"
    f.write_text("")
    table = Adapters(str(f), validate, "base")
    asyncio.run(table.refresh())
    assert table.served == {} and table.file_errors == 0
    f.write_text(f"a={a}")
    asyncio.run(table.refresh())
    served = dict(table.served)
    assert list(served) == ["a"]
    for blank in ("", "\n  \n"):
        f.write_text(blank)
        asyncio.run(table.refresh())
        assert table.served == served
    assert table.file_errors == 2
    f.write_text("{}")
    asyncio.run(table.refresh())
    assert table.served == {} and table.resolve(None, "a", True).code == "model_not_found"

def test_files_rewritten_in_place_with_their_mtime_restored_are_a_new_version(tmp_path: Path) -> None:
    """``cp -p`` / ``rsync -t --inplace`` write the same inode and size and put the old mtime
    back: with only size, mtime and inode in the version the table kept the old id, and the
    engine's cache kept serving the old weights under it."""
    a = adapter_dir(tmp_path, "a")
    table = Adapters(f"a={a}", validate, "base")
    asyncio.run(table.refresh())
    before = table.served["a"].lora_int_id
    weights = a / "adapter_model.safetensors"
    st = os.stat(weights)
    for _ in range(200):  # the kernel's clock is coarse: write until the ctime has moved
        with open(weights, "r+b") as f:
            f.write(b"y")  # same size, same inode
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
        if os.stat(weights).st_ctime_ns != st.st_ctime_ns:
            break
        time.sleep(0.01)
    assert os.stat(weights).st_mtime_ns == st.st_mtime_ns
    asyncio.run(table.refresh())
    assert table.served["a"].lora_int_id != before
