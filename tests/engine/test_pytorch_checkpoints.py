"""Folders that hold PyTorch's ``pytorch_model.bin`` instead of safetensors (older uploads): one
file or shards with their index serve the very model the safetensors copy does; a file that is
not a state dict, a truncated one, or one whose pickle would run code is refused in one line
naming it, and no code runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from safetensors.torch import save_file

from qworker.model.batch import Batch, SeqChunk
from qworker.model.loader import checkpoint_files
from qworker.model.runner import ModelRunner
from tests.engine.family_models import build_family_model

IDS = list(range(200, 240))


@pytest.fixture(scope="module")
def as_safetensors(tmp_path_factory, model_dir) -> Path:
    return build_family_model("qwen3_moe", tmp_path_factory.mktemp("pt") / "st", model_dir, tie_word_embeddings=True)


def _as_pytorch(src: Path, dst: Path, shards: int = 1) -> Path:
    """``src``'s tensors as PyTorch files (``torch.save``, as transformers 4 wrote them): one
    ``pytorch_model.bin``, or ``shards`` files and their index."""
    from safetensors.torch import load_file

    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    state = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(f).items()}
    if shards == 1:
        torch.save(state, dst / "pytorch_model.bin")
        return dst
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = names[i::shards]
        torch.save({k: state[k] for k in part}, dst / file)
        weight_map.update({k: file for k in part})
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def _logits(path: Path) -> torch.Tensor:
    runner = ModelRunner(path, device="cpu", dtype="float32")
    runner.allocate_kv_cache(num_blocks=8, num_cpu_blocks=0, block_size=16)
    return runner.execute(Batch([SeqChunk(IDS, 0, [0, 1, 2], True)]))


@pytest.mark.parametrize("sharded", [False, True])
def test_pytorch_checkpoints_serve_the_same_model(as_safetensors, tmp_path, sharded):
    path = _as_pytorch(as_safetensors, tmp_path / "pt", shards=3 if sharded else 1)
    files = checkpoint_files(path)
    assert (len(files) > 1) == sharded and all(f.name.startswith("pytorch_model") for f in files)
    assert torch.equal(_logits(path), _logits(as_safetensors))


class _RunsCode:
    def __reduce__(self):
        return (Path.touch, (Path(_RunsCode.marker),))


@pytest.mark.parametrize("content", ["not_a_dict", "truncated", "runs_code"])
def test_a_bad_pytorch_file_is_refused_in_one_line(as_safetensors, tmp_path, content):
    path = _as_pytorch(as_safetensors, tmp_path / "pt")
    target = path / "pytorch_model.bin"
    _RunsCode.marker = str(tmp_path / "code-ran")
    if content == "not_a_dict":
        torch.save([torch.zeros(2)], target)
        why = "not a PyTorch state dict"
    elif content == "truncated":
        target.write_bytes(target.read_bytes()[:5000])
        why = "not a readable PyTorch checkpoint"
    else:
        torch.save({"model.embed_tokens.weight": _RunsCode()}, target)  # a full unpickle would touch the marker
        why = "not a readable PyTorch checkpoint"
    with pytest.raises(ValueError, match=f"pytorch_model.bin: {why}"):
        ModelRunner(path, device="cpu", dtype="float32")
    assert not (tmp_path / "code-ran").exists()


def test_a_folder_without_weights_names_both_formats(as_safetensors, tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(as_safetensors / name, path / name)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors or pytorch_model.bin in"):
        ModelRunner(path, device="cpu", dtype="float32")


def test_pytorch_files_win_over_a_stray_safetensors_file(as_safetensors, tmp_path):
    """helper-96: a Mistral-style consolidated.safetensors beside pytorch_model.bin was read instead
    (transformers reads pytorch_model.bin; the glob of every *.safetensors is the last resort)."""
    path = _as_pytorch(as_safetensors, tmp_path / "pt")
    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, path / "consolidated.safetensors")
    assert checkpoint_files(path) == [path / "pytorch_model.bin"]
    assert torch.equal(_logits(path), _logits(as_safetensors))


def test_a_plain_pickle_is_refused_without_torchs_warnings(as_safetensors, tmp_path):
    """helper-99: torch warned about the old pickle protocol in two lines before the one-line refusal."""
    import pickle
    import warnings

    path = _as_pytorch(as_safetensors, tmp_path / "pt")
    _RunsCode.marker = str(tmp_path / "code-ran")
    (path / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": _RunsCode()}, protocol=4))
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError, match="not a readable PyTorch checkpoint"):
        warnings.simplefilter("always")
        ModelRunner(path, device="cpu", dtype="float32")
    assert not [w for w in caught if "pickle" in str(w.message).lower()]
    assert not (tmp_path / "code-ran").exists()
