"""Rope tables grow on demand (helper-96: Llama 4 Scout's 10M-token context built 10 GB of tables at
start-up): a model starts with tables for the first positions only, and a sequence that runs past
them gets exactly the logits of tables built whole, the one-call C layer loop bound again to the
grown tables."""

from __future__ import annotations

import json
import shutil

import pytest
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


def test_tables_grown_step_by_step_give_the_whole_tables_logits(tmp_path, model_dir, monkeypatch):
    path = build_family_model("llama", tmp_path / "m", model_dir)  # small: 200 steps of the real model took ~15 s
    whole, _ = _run(path, 100)
    monkeypatch.setattr(RotaryEmbedding, "FIRST_ROWS", 32)
    grown, runner = _run(path, 100)
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


def _steps(runner: ModelRunner, n: int, lora_slot: int = -1, run=None) -> list[torch.Tensor]:
    """A 40-token prefill and ``n`` teacher-forced decode steps (tokens 600, 601, ...)."""
    run = run or (lambda batch: runner.execute(batch))
    blocks = list(range(16))
    out = [run(Batch([SeqChunk(list(PROMPT), 0, blocks, True, lora_slot=lora_slot)]))]
    for i in range(n):
        out.append(run(Batch([SeqChunk([600 + i], len(PROMPT) + i, blocks, True, decode=True, lora_slot=lora_slot)])))
    return out


def test_growth_keeps_lora_on(tmp_path, model_dir, monkeypatch):
    """helper-97: after a table grew, the C loop was bound again through the LoRA wrappers (their
    plain weights): every LoRA request then ran the base model, silently."""
    from qworker.model.lora.adapter import load_lora_adapter
    from tests.engine.lora_support import ALL_MODULES, make_peft_adapter

    path = build_family_model("llama", tmp_path / "m", model_dir)
    adapter = make_peft_adapter(path, tmp_path / "a", rank=8, alpha=16, seed=1, target_modules=ALL_MODULES)

    def runner() -> ModelRunner:
        r = ModelRunner(path, device="cpu", dtype="float32")
        r.allocate_kv_cache(num_blocks=16, num_cpu_blocks=0, block_size=16)
        r.enable_lora(max_loras=1, max_rank=8)
        r.set_lora(0, load_lora_adapter(adapter, r.config, 8))
        return r

    whole = _steps(runner(), 20, lora_slot=0)
    monkeypatch.setattr(RotaryEmbedding, "FIRST_ROWS", 32)
    grown = _steps(runner(), 20, lora_slot=0)
    for step, (a, b) in enumerate(zip(whole, grown)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=lambda m: f"step {step}: {m}")


def test_growth_keeps_the_tensor_parallel_all_reduce(family_models, monkeypatch):
    """helper-97: the same rebinding read RowParallel's plain shard weights, so each rank's C loop
    ran its shard without the all-reduce."""
    from qworker.model.parallel.build import TPRank
    from tests.engine.test_tensor_parallel_shards import ThreadGroup, run_ranks

    path = family_models.get("llama")
    whole = ModelRunner(path, "cpu", "float32")
    whole.allocate_kv_cache(16, 0, 16)
    want = _steps(whole, 12)
    monkeypatch.setattr(RotaryEmbedding, "FIRST_ROWS", 32)
    group = ThreadGroup(2)
    ranks = [ModelRunner(path, "cpu", "float32", tp=TPRank(r, 2, group.all_reduce_for(r))) for r in range(2)]
    for r in ranks:
        r.allocate_kv_cache(16, 0, 16)
    got = _steps(ranks[0], 12, run=lambda batch: run_ranks(ranks, batch)[0])
    assert ranks[0].model.rope.cos.shape[0] > 32
    for step, (a, b) in enumerate(zip(want, got)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("family", ["gemma3_text", "phi3", "deepseek_v3", "llama4_text"])
def test_growth_in_every_table_of_a_family(family, family_models, monkeypatch):
    """Several tables (Gemma 3's per layer type), partial rotary (Phi-3, DeepSeek's MLA), NoPE and
    chunked layers (Llama 4): each table grows alike and the logits are those of whole tables."""
    path = family_models.get(family)

    def runner() -> ModelRunner:
        r = ModelRunner(path, device="cpu", dtype="float32")
        r.allocate_kv_cache(num_blocks=16, num_cpu_blocks=0, block_size=16)
        return r

    whole = _steps(runner(), 30)
    monkeypatch.setattr(RotaryEmbedding, "FIRST_ROWS", 16)
    r = runner()
    grown = _steps(r, 30)
    assert all(rope.cos.shape[0] >= 70 for rope in r.model.ropes.values())
    for step, (a, b) in enumerate(zip(whole, grown)):
        assert torch.equal(a, b), f"{family} step {step}"
