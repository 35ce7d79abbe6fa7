"""Shared fixtures: the real test model (SmolLM2-135M-Instruct, fetched by `make model`) and a
tiny random-weight Llama for fast unit tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A test process builds and drops hundreds of engines: the first one's start-up heap frozen out of
# the cyclic GC (qworker/engine/llm_engine.py) would stay for the whole session (~1 GB with the
# fp32 test model). tests/engine/test_gc_freeze.py runs the freeze in processes of its own.
os.environ.setdefault("QWORKER_GC_FREEZE", "0")


def real_model_dir() -> Path:
    path = Path(os.environ.get("QWORKER_TEST_MODEL", ROOT / "models" / "smollm2-135m"))
    if not (path / "config.json").exists():
        pytest.fail(f"test model missing at {path}: run `make model` (qworker.model.fetch)")
    return path


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return real_model_dir()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, model_dir) -> Path:
    """A 2-layer random-weight Llama with the real tokenizer (same vocabulary)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)
    return out
