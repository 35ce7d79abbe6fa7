"""gpt-oss's released checkpoints hold the MoE experts in MXFP4 (``quantization_config``
``mxfp4``): the family dequantizes them as they are read. Checked against transformers' own
dequantization on random blocks, and end to end: a tiny gpt-oss written with MXFP4 experts serves
exactly the logits of the same model written with the dequantized weights. (Its outputs against
transformers' model are in tests/engine/test_model_families.py with every family.)"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from qworker.model.batch import Batch, SeqChunk
from qworker.model.families.gpt_oss import _FP4_VALUES, dequantize_mxfp4
from qworker.model.runner import ModelRunner
from tests.engine.family_models import build_family_model


def test_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 40, 4), dtype=torch.uint8, generator=gen)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)  # [E, out, in]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(ours, theirs.transpose(1, 2))


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` ``[E, out, in]`` -> (blocks, scales, the values they hold): per 32 inputs a power of two
    and the nearest e2m1 value of each weight over it."""
    E, out, n = w.shape
    x = w.reshape(E, out, n // 32, 32)
    exp = torch.ceil(torch.log2(x.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)
    table = torch.tensor(_FP4_VALUES)
    idx = ((x / torch.exp2(exp)[..., None]).unsqueeze(-1) - table).abs().argmin(-1).to(torch.uint8)  # [E, out, G, 32]
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    scales = (exp + 127).to(torch.uint8)
    return blocks, scales, dequantize_mxfp4(blocks, scales, torch.float32)


def test_mxfp4_experts_serve_the_model_their_values_make(model_dir, tmp_path):
    src = build_family_model("gpt_oss", tmp_path / "src", model_dir, intermediate_size=64)
    tensors = load_file(src / "model.safetensors")
    plain, packed = dict(tensors), dict(tensors)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales, values = _quantize(tensors[name].transpose(1, 2).contiguous())
        plain[name] = values.transpose(1, 2).contiguous()  # what the blocks hold, in the checkpoint's [E, in, out]
        del packed[name]
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
    config = json.loads((src / "config.json").read_text())
    outs = []
    for name, weights, quant in (("plain", plain, None), ("mxfp4", packed, {"quant_method": "mxfp4"})):
        folder = tmp_path / name
        folder.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (folder / f).write_bytes((src / f).read_bytes())
        (folder / "config.json").write_text(json.dumps({**config, **({"quantization_config": quant} if quant else {})}))
        save_file(weights, folder / "model.safetensors")
        runner = ModelRunner(str(folder), dtype="float32")
        runner.allocate_kv_cache(num_blocks=8, num_cpu_blocks=0, block_size=16)
        outs.append(runner.execute(Batch([SeqChunk(list(range(5, 45)), 0, [0, 1, 2], True)])))
    assert torch.equal(outs[0], outs[1])
