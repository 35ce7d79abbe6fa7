"""The first engine of a process freezes the start-up heap out of the cyclic collector's reach
(llm_engine._freeze_start_up_heap), once: later engines leave the frozen set as it is, the engine
still generates, and QWORKER_GC_FREEZE=0 turns it off. Each case runs in a fresh interpreter:
the freeze is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import gc, json, sys
from qworker import LLM, SamplingParams
before = gc.get_freeze_count()
first = LLM(sys.argv[1], dtype="float32", kv_cache_memory=16 << 20)
after_first = gc.get_freeze_count()
second = LLM(sys.argv[1], dtype="float32", kv_cache_memory=16 << 20)
after_second = gc.get_freeze_count()
out = second.generate(["Hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
print(json.dumps([before, after_first, after_second, len(out[0].outputs[0].token_ids)]))
"""


def _run(model_dir: Path, **env: str) -> list[int]:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(model_dir)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_first_engine_freezes_the_start_up_heap_once(tiny_model_dir):
    before, after_first, after_second, generated = _run(tiny_model_dir, QWORKER_GC_FREEZE="1")
    assert before == 0
    assert after_first > 10_000  # the model, tokenizer and libraries
    assert after_second == after_first  # once per process: the second engine stays collectable
    assert generated == 3


def test_freeze_can_be_turned_off(tiny_model_dir):
    before, after_first, after_second, generated = _run(tiny_model_dir, QWORKER_GC_FREEZE="0")
    assert before == after_first == after_second == 0
    assert generated == 3
