"""load_lora_adapter: real PEFT adapters load with PEFT's scaling folded into B; missing, malformed
and hostile folders are refused with a LoRAAdapterError that names the file or field.

Adapters come from ``peft`` on the tiny 2-layer Llama (hidden 64, q 64, kv 32, intermediate 128);
hostile ones are PEFT's files edited, or safetensors written by hand where PEFT cannot make them.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from qworker.model.loader import load_config
from qworker.model.lora.adapter import LoRAAdapterError, load_lora_adapter, moe_layers
from tests.engine.lora_support import edit_adapter_config, make_peft_adapter

PREFIX = "base_model.model.model.layers"


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_model_dir):
    """One PEFT adapter (rank 4, rsLoRA off, patterns on) made once; tests copy it."""
    out = tmp_path_factory.mktemp("lora-made")
    adapter = make_peft_adapter(tiny_model_dir, out / "a", rank=4, alpha=12, seed=3,
                                target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
                                rank_pattern={"layers.1.self_attn.q_proj": 2}, alpha_pattern={"down_proj": 5})
    return adapter


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return load_config(tiny_model_dir)


@pytest.fixture
def adapter(made, tmp_path):
    dst = tmp_path / "adapters" / "a"
    shutil.copytree(made, dst)
    return dst


def refused(path, config, *needles, max_rank=8, root=None):
    with pytest.raises(LoRAAdapterError) as info:
        load_lora_adapter(path, config, max_rank, root=root)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


def rewrite_tensors(adapter_dir, edit):
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def test_peft_adapter_loads_with_scaling_folded(made, config):
    a = load_lora_adapter(made, config, max_rank=8)
    raw = load_file(str(made / "adapter_model.safetensors"))
    assert a.rank == 4
    assert a.target_modules == {"q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"}
    assert len(a.weights) == 2 * 5
    for (layer, module), (A, B) in a.weights.items():
        group = "self_attn" if module in ("q_proj", "v_proj", "o_proj") else "mlp"
        key = f"{PREFIX}.{layer}.{group}.{module}"
        r = 2 if (layer, module) == (1, "q_proj") else 4
        alpha = 5 if module == "down_proj" else 12
        assert A.dtype == B.dtype == torch.float32 and A.shape[0] == r and B.shape[1] == r
        torch.testing.assert_close(A, raw[f"{key}.lora_A.weight"])
        torch.testing.assert_close(B, raw[f"{key}.lora_B.weight"] * (alpha / r))
        assert B.abs().sum() > 0
    assert a.weights[0, "q_proj"][0].shape == (4, 64) and a.weights[0, "v_proj"][1].shape == (32, 4)
    assert a.weights[0, "down_proj"][0].shape == (4, 128) and a.weights[0, "gate_proj"][1].shape == (128, 4)
    assert a.nbytes == sum(x.nbytes + y.nbytes for x, y in a.weights.values())


def test_rslora_scaling(adapter, config):
    """rsLoRA: alpha / sqrt(r), with the module's own r and alpha from the patterns."""
    edit_adapter_config(adapter, use_rslora=True)
    raw = load_file(str(adapter / "adapter_model.safetensors"))
    a = load_lora_adapter(adapter, config, max_rank=8)
    torch.testing.assert_close(a.weights[0, "down_proj"][1], raw[f"{PREFIX}.0.mlp.down_proj.lora_B.weight"] * (5 / math.sqrt(4)))
    torch.testing.assert_close(a.weights[1, "q_proj"][1], raw[f"{PREFIX}.1.self_attn.q_proj.lora_B.weight"] * (12 / math.sqrt(2)))
    torch.testing.assert_close(a.weights[0, "q_proj"][1], raw[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"] * (12 / math.sqrt(4)))


def test_missing_and_non_safetensors(adapter, config, tmp_path):
    refused(tmp_path / "nope", config, "does not exist")
    refused(adapter / "adapter_config.json", config, "not a folder")
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    refused(adapter, config, "adapter_model.bin", "adapter_model.safetensors only")
    (adapter / "adapter_model.bin").unlink()
    refused(adapter, config, "adapter_model.safetensors is missing")
    (adapter / "adapter_config.json").unlink()
    refused(adapter, config, "adapter_config.json is missing")


def test_malformed_config(adapter, config):
    cfg = adapter / "adapter_config.json"
    cfg.write_text("{not json")
    refused(adapter, config, "adapter_config.json", "not valid JSON")
    cfg.write_text("[1, 2]")
    refused(adapter, config, "must be a JSON object")
    cfg.write_text(json.dumps({"peft_type": "IA3", "r": 4}))
    refused(adapter, config, "peft_type", "IA3")
    cfg.write_text(json.dumps({"peft_type": "LORA", "r": "4"}))
    refused(adapter, config, "r must be an int")
    cfg.write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": float("nan")}))
    refused(adapter, config, "lora_alpha")


@pytest.mark.parametrize("field,value,needle", [
    ("use_dora", True, "use_dora"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("bias", "all", "bias"),
    ("lora_bias", True, "lora_bias"),
    ("target_modules", ["q_proj", "embed_tokens"], "embed_tokens"),
    ("target_modules", ["lm_head"], "lm_head"),
    ("rank_pattern", {"model\\.layers\\.(0|1)\\.self_attn\\.q_proj": 2}, "rank_pattern"),
    ("alpha_pattern", {"q_proj": "x"}, "alpha_pattern"),
])
def test_unsupported_config_fields(adapter, config, field, value, needle):
    edit_adapter_config(adapter, **{field: value})
    refused(adapter, config, needle)


def test_rank_above_max(adapter, config):
    refused(adapter, config, "r=4", "max_lora_rank=3", max_rank=3)
    edit_adapter_config(adapter, rank_pattern={"layers.1.self_attn.q_proj": 9})
    refused(adapter, config, "rank_pattern", "max_lora_rank=8")


def test_tensor_rank_above_max_is_refused_from_the_header(adapter, config):
    """A file whose A claims rank 64 (config says 4): refused before reading the tensors."""
    rewrite_tensors(adapter, lambda t: t.update({f"{PREFIX}.0.self_attn.q_proj.lora_A.weight": torch.zeros(64, 64)}))
    refused(adapter, config, "q_proj.lora_A", "rank 64", "max_lora_rank=8")


def test_shapes_must_match_the_base_model(adapter, config):
    name = f"{PREFIX}.0.self_attn.v_proj.lora_B.weight"
    rewrite_tensors(adapter, lambda t: t.update({name: torch.ones(64, 4)}))  # v's out is 32
    refused(adapter, config, name, "[64, 4]", "expected [32, 4]")


def test_unknown_missing_and_out_of_range_tensors(adapter, config, made):
    rewrite_tensors(adapter, lambda t: t.update({f"{PREFIX}.0.self_attn.q_proj.extra": torch.ones(2)}))
    refused(adapter, config, "q_proj.extra")
    shutil.copy(made / "adapter_model.safetensors", adapter)
    rewrite_tensors(adapter, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.ones(4, 64)}))
    refused(adapter, config, "lm_head")
    shutil.copy(made / "adapter_model.safetensors", adapter)
    rewrite_tensors(adapter, lambda t: t.update({f"{PREFIX}.2.self_attn.q_proj.lora_A.weight": torch.ones(4, 64),
                                                 f"{PREFIX}.2.self_attn.q_proj.lora_B.weight": torch.ones(64, 4)}))
    refused(adapter, config, "layer 2", "2 layers")
    shutil.copy(made / "adapter_model.safetensors", adapter)
    rewrite_tensors(adapter, lambda t: t.pop(f"{PREFIX}.0.self_attn.o_proj.lora_B.weight"))
    refused(adapter, config, "o_proj.lora_A", "no lora_B")
    shutil.copy(made / "adapter_model.safetensors", adapter)
    rewrite_tensors(adapter, lambda t: t.update({f"{PREFIX}.0.mlp.q_proj.lora_A.weight": torch.ones(4, 64)}))
    refused(adapter, config, "q_proj does not sit under mlp")
    save_file({}, str(adapter / "adapter_model.safetensors"))
    refused(adapter, config, "no LoRA tensors")


def test_nan_and_inf_weights(adapter, config, made):
    name = f"{PREFIX}.1.mlp.gate_proj.lora_A.weight"

    def poison(t):
        t[name] = t[name].clone()
        t[name][0, 0] = float("nan")
    rewrite_tensors(adapter, poison)
    refused(adapter, config, name, "NaN or Inf")
    shutil.copy(made / "adapter_model.safetensors", adapter)
    name_b = f"{PREFIX}.0.self_attn.o_proj.lora_B.weight"
    rewrite_tensors(adapter, lambda t: t.update({name_b: torch.full_like(t[name_b], float("inf"))}))
    refused(adapter, config, name_b)
    shutil.copy(made / "adapter_model.safetensors", adapter)
    rewrite_tensors(adapter, lambda t: t.update({name_b: t[name_b].to(torch.int32)}))
    refused(adapter, config, name_b, "dtype")


def _raw_safetensors(path, header: dict, data: bytes = b""):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_huge_declared_shapes_are_refused_from_the_header(adapter, config):
    """The header claims a [1e9, 64] tensor in a file of a few bytes: refused, nothing allocated."""
    name = f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"
    st = adapter / "adapter_model.safetensors"
    _raw_safetensors(st, {name: {"dtype": "F32", "shape": [10**9, 64], "data_offsets": [0, 4 * 64 * 10**9]}}, b"\0" * 16)
    refused(adapter, config, name, "data_offsets")
    st.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    refused(adapter, config, "adapter_model.safetensors", "header length")
    st.write_bytes(b"\x01\x02")
    refused(adapter, config, "not a safetensors file")
    _raw_safetensors(st, {name: {"dtype": "F32", "shape": [4, 64], "data_offsets": [0, 1024]}, "x": 3}, b"\0" * 1024)
    refused(adapter, config, "'x'", "malformed")


def test_symlinks_outside_the_folder_are_refused(adapter, config, tmp_path, made):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(made / "adapter_model.safetensors", outside / "w.safetensors")
    st = adapter / "adapter_model.safetensors"
    st.unlink()
    os.symlink(outside / "w.safetensors", st)
    refused(adapter, config, "adapter_model.safetensors", "symlink", "outside the adapter folder")
    st.unlink()
    shutil.copy(made / "adapter_model.safetensors", adapter / "real.safetensors")
    os.symlink("real.safetensors", st)  # inside the folder: fine
    assert load_lora_adapter(adapter, config, 8).rank == 4
    os.symlink("/etc/passwd", adapter / "README.md.link")  # any entry, even one never read
    refused(adapter, config, "README.md.link", "outside the adapter folder")


def test_root_confines_the_folder(adapter, config, tmp_path, made):
    root = adapter.parent
    assert load_lora_adapter(adapter, config, 8, root=root).rank == 4
    refused(made, config, "outside the adapter root", root=root)
    link = root / "sneaky"
    os.symlink(made, link)  # a folder symlink out of the root
    refused(link, config, "outside the adapter root", root=root)
    refused(link, config, "symlink", "outside")  # without a root: outside the folder it sits in
    refused(root / ".." / ".." / made.parent.name / made.name, config, "outside the adapter root", root=root)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_mlp_lora_on_a_moe_layer_is_refused(tmp_path, model_type):
    """Qwen3-MoE / Qwen2-MoE with layer 0 dense (mlp_only_layers) and layer 1 sparse: gate_proj on
    layer 0 loads (Qwen2-MoE's was refused as if every layer were sparse), on layer 1 it is refused
    naming the layer (hand-written tensors: no HF model needed)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                  num_experts_per_tok=2, mlp_only_layers=[0])
    assert moe_layers(config) == {1}
    d = tmp_path / "moe"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["gate_proj"]}))
    tensors = {f"{PREFIX}.0.mlp.gate_proj.lora_A.weight": torch.randn(2, 32), f"{PREFIX}.0.mlp.gate_proj.lora_B.weight": torch.randn(48, 2)}
    save_file(tensors, str(d / "adapter_model.safetensors"))
    a = load_lora_adapter(d, config, 4)
    torch.testing.assert_close(a.weights[0, "gate_proj"][1], tensors[f"{PREFIX}.0.mlp.gate_proj.lora_B.weight"] * 2)
    tensors.update({f"{PREFIX}.1.mlp.gate_proj.lora_A.weight": torch.randn(2, 32), f"{PREFIX}.1.mlp.gate_proj.lora_B.weight": torch.randn(48, 2)})
    save_file(tensors, str(d / "adapter_model.safetensors"))
    refused(d, config, "layer 1", "mixture-of-experts")


def _peft_adapted(base_dir, adapter_dir) -> set[tuple[int, str]]:
    """The (layer, module) pairs PEFT wraps with this adapter's LoRA layers."""
    import re

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(adapter_dir))
    found = set()
    for name, module in model.named_modules():
        if "default" in getattr(module, "lora_A", {}):
            m = re.search(r"layers\.(\d+)\.\w+\.(\w+)$", name)
            found.add((int(m[1]), m[2]))
    return found


@pytest.mark.parametrize("changes", [
    {"target_modules": ["q_proj", "down_proj"]},
    {"target_modules": ["self_attn.v_proj", "layers.1.mlp.gate_proj"]},
    {"layers_to_transform": [1], "layers_pattern": "layers"},
    {"layers_to_transform": 0},
    {"exclude_modules": ["o_proj", "layers.0.self_attn.q_proj"]},
    {"target_modules": ["model.layers.0.self_attn.q_proj", "v_proj"], "layers_to_transform": [1]},
    {"layers_to_transform": [1], "layers_pattern": ""},
    {"layers_to_transform": [0], "layers_pattern": "model.layers"},
    {"layers_to_transform": [1], "layers_pattern": ["h", "layers"]},
])
def test_the_configs_targets_decide_what_applies_as_in_peft(adapter, config, tiny_model_dir, changes):
    """The file holds q/v/o/gate/down of both layers; a config that adapts fewer modules gets
    exactly the ones PEFT wraps (PEFT skips the other tensors: helper-58 saw them applied), each
    with its own weights."""
    edit_adapter_config(adapter, **changes)
    loaded = load_lora_adapter(adapter, config, 8)
    want = _peft_adapted(tiny_model_dir, adapter) & {(i, m) for i in (0, 1) for m in ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")}
    assert want and set(loaded.weights) == want
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    for (layer, module), (a, _) in loaded.weights.items():
        group = "self_attn" if module.endswith(("q_proj", "v_proj", "o_proj")) else "mlp"
        assert torch.equal(a, tensors[f"{PREFIX}.{layer}.{group}.{module}.lora_A.weight"].float())


@pytest.mark.parametrize(("changes", "needle"), [
    ({"exclude_modules": ".*q_proj"}, "regular expression"),
    ({"exclude_modules": [3]}, "exclude_modules must be a list"),
    ({"layers_to_transform": ["0"]}, "layers_to_transform must be"),
    ({"layers_to_transform": [0], "layers_pattern": "h"}, "layers_pattern"),
    ({"target_modules": ["k_proj"]}, "no LoRA tensors for the modules"),
    ({"target_modules": ...}, "target_modules is missing"),
    ({"target_modules": None}, "target_modules is missing"),
    ({"layers_pattern": "layers"}, "without layers_to_transform"),
])
def test_target_fields_that_cannot_be_honoured_are_refused(adapter, config, changes, needle):
    edit_adapter_config(adapter, **changes)
    refused(adapter, config, "adapter_", needle)


def test_a_loaded_adapter_owns_its_weights_when_the_file_is_rewritten_in_place(adapter, config):
    """safetensors' tensors are views of the file's memory map: the A matrices (fp32 in the file,
    so ``.to(float32)`` did not copy) followed the file when it was rewritten in place, and a file
    cut short killed the worker with SIGBUS at the adapter's next use."""
    a = load_lora_adapter(adapter, config, max_rank=8)
    before = {k: (A.clone(), B.clone()) for k, (A, B) in a.weights.items()}
    path = adapter / "adapter_model.safetensors"
    data = path.read_bytes()
    header = 8 + struct.unpack("<Q", data[:8])[0]
    with open(path, "r+b") as f:  # same inode, other bytes: what an operator's save does
        f.write(data[:header] + bytes(len(data) - header))
    for k, (A, B) in a.weights.items():
        assert torch.equal(A, before[k][0]) and torch.equal(B, before[k][1]), k
    with open(path, "r+b") as f:
        f.truncate(header)
    assert sum(float(A.abs().sum()) for A, _ in a.weights.values()) > 0  # reads every page: no SIGBUS


def test_an_adapter_is_read_as_one_snapshot_of_its_file(adapter, config, monkeypatch):
    """The file cut short between reading its header and its tensors (the reload loop reads
    adapters whenever an operator saves one): the tensors came from a memory map of the file as
    it was then (a SIGBUS where a page was gone, for a large adapter); they come from the bytes
    read with the header."""
    from qworker.model.lora import adapter as mod

    path = adapter / "adapter_model.safetensors"
    want = load_lora_adapter(adapter, config, max_rank=8).weights
    real = mod._expected_shapes

    def cut_short(*args, **kw):
        with open(path, "r+b") as f:
            f.truncate(16)
        return real(*args, **kw)

    monkeypatch.setattr(mod, "_expected_shapes", cut_short)
    got = load_lora_adapter(adapter, config, max_rank=8).weights
    assert got.keys() == want.keys() and all(torch.equal(got[k][0], want[k][0]) and torch.equal(got[k][1], want[k][1]) for k in want)


def test_a_shared_expert_tensor_is_named_as_an_expert():
    """helper-83: PEFT's ``down_proj`` target also adapts Qwen2-MoE's ``mlp.shared_expert.down_proj``,
    which was refused as "not a LoRA A/B weight of ..., down_proj": confusing, down_proj is allowed."""
    from qworker.model.lora.adapter import _unsupported_name

    why = _unsupported_name("base_model.model.model.layers.0.mlp.shared_expert.down_proj.lora_A.weight")
    assert "targets a MoE expert" in why and "not a LoRA A/B weight" not in why
