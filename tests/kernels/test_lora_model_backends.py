"""LoRA through the model on both kernel backends: the Triton backend (SGMV shrink/expand over the
stack layout; on CPU under the interpreter) gives the logits of the CPU backend (grouped GEMMs,
itself checked against PEFT in tests/engine/test_lora_model.py) for a batch that mixes two
adapters of different ranks and target subsets with base rows, in prefill and in decode steps."""

from __future__ import annotations

import pytest
import torch

from qworker.model.batch import Batch, SeqChunk
import qworker.model.lora.apply as apply_mod
from qworker.model.lora.adapter import LoRAAdapter
from qworker.model.runner import ModelRunner

MODULE_DIMS = {"q_proj": (128, 128), "k_proj": (128, 64), "v_proj": (128, 64), "o_proj": (128, 128),
               "gate_proj": (128, 256), "up_proj": (128, 256), "down_proj": (256, 128)}


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("small-llama-lora")
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    return out


def random_adapter(gen, rank: int, modules, layers=(0, 1)) -> LoRAAdapter:
    weights = {}
    for layer in layers:
        for m in modules:
            fin, fout = MODULE_DIMS[m]
            weights[layer, m] = (torch.randn(rank, fin, generator=gen) / fin**0.5, torch.randn(fout, rank, generator=gen) * 0.3)
    return LoRAAdapter(rank=rank, weights=weights, path=f"random-r{rank}")


def test_triton_lora_matches_cpu_lora(small_llama, seed, device):
    gen = torch.Generator().manual_seed(seed)
    adapters = [random_adapter(gen, 8, MODULE_DIMS), random_adapter(gen, 3, ["q_proj", "v_proj", "down_proj"], layers=(1,))]
    runners = {b: ModelRunner(small_llama, device=str(dev), dtype="float32", kernel_backend=b)
               for b, dev in (("cpu", torch.device("cpu")), ("triton", device))}
    for r in runners.values():
        r.allocate_kv_cache(num_blocks=12, num_cpu_blocks=0, block_size=16)
        r.enable_lora(max_loras=3, max_rank=8)
        r.set_lora(0, adapters[0])
        r.set_lora(2, adapters[1])
    assert runners["triton"].lora.layout == "stack" and runners["cpu"].lora.layout == "grouped"
    assert apply_mod._sgmv(), "the Triton backend must run the SGMV kernels, not the torch fallback"
    ids = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (19, 6, 33, 11)]
    slots = [0, -1, 2, 0]
    tables = [[0, 1], [2], [3, 4, 5], [6]]
    prefill = Batch([SeqChunk(t, 0, tb, True, lora_slot=s) for t, tb, s in zip(ids, tables, slots)])
    # decode: the slots' rows interleaved (0, 2, base, 0)
    order = [0, 2, 1, 3]
    decode = Batch([SeqChunk([5 + i], len(ids[i]), tables[i], True, lora_slot=slots[i]) for i in order])
    base = Batch([SeqChunk(t, 0, tb, True) for t, tb in zip(ids, tables)])
    for step in (prefill, decode):
        cpu, triton = (runners[b].execute(step).cpu() for b in ("cpu", "triton"))
        torch.testing.assert_close(triton, cpu, rtol=1e-4, atol=1e-4)
    plain = runners["cpu"].execute(base)
    lora = runners["cpu"].execute(prefill)
    for i, s in enumerate(slots):
        moved = (lora[i] - plain[i]).abs().max().item()
        assert (moved > 1e-2) if s >= 0 else moved == 0, f"sequence {i} (slot {s}): {moved}"
