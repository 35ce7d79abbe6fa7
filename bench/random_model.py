"""A copy of a model folder with random weights, for timing where the real weights cannot travel
(a lent GPU machine gets the config and tokenizer, not 538 MB of safetensors). A step's speed does
not depend on the weights' values."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch


def random_weight_copy(model_dir: str) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    src = Path(model_dir)
    out = Path(tempfile.mkdtemp(prefix="qworker-random-"))
    config = AutoConfig.from_pretrained(src)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out, safe_serialization=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, out / f.name)
    return str(out)
