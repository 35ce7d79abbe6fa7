"""Small file checks the model fetchers share: whether a folder holds a model, and a file's sha256.

Below both ``fetch`` and ``fetch_gemma3`` so that neither imports the other for them (``fetch``
dispatches to ``fetch_gemma3``; the arrow runs one way only)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def is_model_dir(path: Path) -> bool:
    """A config and at least one safetensors file: enough for a fetcher to leave the folder be."""
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
