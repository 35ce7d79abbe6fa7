"""The test model is the same bytes everywhere: the converter's own safetensors writer lays files
out as the safetensors library does, a folder with other weights fails with a clear message, and
the test model in use has the pinned sha256."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from qworker.model import fetch


def test_writer_matches_safetensors_library(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(shape).astype(np.float32)
               for name, shape in [("b.weight", (3, 5)), ("a.weight", (7,)), ("model.layers.10.x", (2, 2, 3)), ("model.layers.2.x", (1,))]}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    fetch.write_safetensors(ours, tensors)
    save_file(tensors, str(theirs), metadata={"format": "pt"})
    assert ours.read_bytes() == theirs.read_bytes()
    loaded = load_file(str(ours))
    assert set(loaded) == set(tensors) and all(np.array_equal(loaded[k], v) for k, v in tensors.items())


def test_reverse_permute_undoes_llama_cpp_permutation():
    n_head, head_dim, cols = 3, 8, 5
    w = np.arange(n_head * head_dim * cols, dtype=np.float32).reshape(n_head * head_dim, cols)
    # llama.cpp's convert_hf_to_gguf.py permute()
    permuted = w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(fetch._reverse_permute(permuted, n_head), w)


def test_verify_rejects_other_weights(tmp_path):
    fetch.write_safetensors(tmp_path / "model.safetensors", {"w": np.ones((2, 2), np.float32)})
    with pytest.raises(fetch.ModelMismatchError, match="expected " + fetch.MODEL_SHA256):
        fetch.verify(tmp_path)
    with pytest.raises(fetch.ModelMismatchError, match="does not exist"):
        fetch.verify(tmp_path / "missing")


def test_test_model_has_pinned_bytes(model_dir):
    fetch.verify(model_dir)
