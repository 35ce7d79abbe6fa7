"""Rope tables grow on demand (helper-96: Llama 4 Scout's 10M-token context built 10 GB of tables at
start-up): a model starts with tables for the first positions only, and a sequence that runs past
them gets exactly the logits of tables built whole, the one-call C layer loop bound again to the
grown tables."""

from __future__ import annotations

import json
import shutil

import torch

from qworker.model.batch import Batch, SeqChunk
from qworker.model.rope import RotaryEmbedding
from qworker.model.runner import ModelRunner
from tests.engine.family_models import build_family_model

PROMPT = list(range(500, 540))


def _run(path, steps: int) -> tuple[list[torch.Tensor], ModelRunner]:
    """A 40-token prefill, then ``steps`` greedy decode steps; every step's logits."""
    runner = ModelRunner(path, device="cpu", dtype="float32")
    runner.allocate_kv_cache(num_blocks=16, num_cpu_blocks=0, block_size=16)
    blocks = list(range(16))
    tokens = list(PROMPT)
    out = [runner.execute(Batch([SeqChunk(tokens, 0, blocks, True)]))]
    for _ in range(steps):
        tokens.append(int(out[-1][0].argmax()))
        out.append(runner.execute(Batch([SeqChunk(tokens[-1:], len(tokens) - 1, blocks, True, decode=True)])))
    return out, runner


def test_tables_grown_step_by_step_give_the_whole_tables_logits(model_dir, monkeypatch):
    whole, _ = _run(model_dir, 100)
    monkeypatch.setattr(RotaryEmbedding, "FIRST_ROWS", 32)
    grown, runner = _run(model_dir, 100)
    rope = runner.model.rope
    assert 140 <= rope.cos.shape[0] < 8192  # grew past 32 rows, not to the model's whole context
    assert runner.model.fused_layers is not None and runner.model.fused_layers.cos is rope.cos  # the C loop bound anew
    for step, (a, b) in enumerate(zip(whole, grown)):
        assert torch.equal(a, b), f"step {step}"


def test_a_ten_million_token_context_starts_with_small_tables(tmp_path, model_dir):
    path = build_family_model("llama", tmp_path / "m", model_dir)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 10_485_760}))
    runner = ModelRunner(path, device="cpu", dtype="float32")
    assert runner.max_model_len == 10_485_760
    assert runner.model.rope.cos.shape[0] == RotaryEmbedding.FIRST_ROWS  # 4 MB, not 670 MB
    shutil.rmtree(path)
