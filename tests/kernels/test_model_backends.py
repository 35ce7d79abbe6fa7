"""The model's two kernel backends agree: the Triton kernels (what the engine runs on CUDA, here on
CPU tensors under the interpreter) and the CPU backend (C kernels, torch references), through the
real model runner on a small random Llama. This checks the CUDA path's wiring without a GPU: the
weight layout, the in-place rotary on views into the fused qkv buffer, strided q/k/v into the
Triton kernels, a mixed step of decodes and a prefill chunk over its cached prefix."""

from __future__ import annotations

import pytest
import torch

import kernels
from qworker.model.batch import Batch, SeqChunk
from qworker.model.runner import ModelRunner


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("small-llama")
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    return out


def test_triton_backend_matches_cpu_backend(small_llama, seed, device):
    """On a CUDA machine the Triton side runs natively on the GPU (fp32), the CPU side on the host."""
    gen = torch.Generator().manual_seed(seed)
    runners = {b: ModelRunner(small_llama, device=str(dev), dtype="float32", kernel_backend=b)
               for b, dev in (("cpu", torch.device("cpu")), ("triton", device))}
    assert runners["triton"].model.attn._decode is kernels.paged_decode_attention
    assert runners["cpu"].model.attn._decode is kernels.paged_decode_attention_cpu
    for r in runners.values():
        r.allocate_kv_cache(num_blocks=12, num_cpu_blocks=0, block_size=16)
    lens = {"a": 21, "b": 5, "c": 40}
    ids = {k: torch.randint(0, 512, (n + 1,), generator=gen).tolist() for k, n in lens.items()}
    pages = torch.randperm(12, generator=gen).tolist()
    tables = {"a": pages[0:2], "b": pages[2:3], "c": pages[3:6]}
    # step 1: prefill a and b whole, c's first 24 tokens (no logits); step 2: decode a and b,
    # prefill c's last 16 tokens over its cached 24
    step1 = Batch([SeqChunk(ids["a"][:21], 0, tables["a"], True), SeqChunk(ids["b"][:5], 0, tables["b"], True),
                   SeqChunk(ids["c"][:24], 0, tables["c"], False)])
    step2 = Batch([SeqChunk(ids["a"][21:22], 21, tables["a"], True), SeqChunk(ids["b"][5:6], 5, tables["b"], True),
                   SeqChunk(ids["c"][24:40], 24, tables["c"], True)])
    for step in (step1, step2):
        cpu, triton = (runners[b].execute(step).cpu() for b in ("cpu", "triton"))
        assert cpu.shape == triton.shape == (sum(c.needs_logits for c in step.chunks), 512)
        torch.testing.assert_close(triton, cpu, rtol=1e-4, atol=1e-4)
    # the two backends wrote the same K/V to the same slots
    for (kc, vc), (kt, vt) in zip(runners["cpu"].kv.layers, runners["triton"].kv.layers):
        torch.testing.assert_close(kt.cpu(), kc, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(vt.cpu(), vc, rtol=1e-5, atol=1e-5)
