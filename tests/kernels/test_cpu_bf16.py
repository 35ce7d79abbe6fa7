"""CPU bf16: a clear error where the CPU has no bf16 GEMM hardware; where it runs (or is forced,
``QWORKER_CPU_BF16=force``), bf16 weights with fp32 activations and a bf16 KV cache give the fp32
model's logits up to bf16 rounding."""

from __future__ import annotations

import pytest
import torch

from qworker.model.batch import Batch, SeqChunk
from qworker.model.linear import check_cpu_bf16
from qworker.model.runner import ModelRunner


def _supported() -> bool:
    try:
        check_cpu_bf16()
        return True
    except ValueError:
        return False


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(11)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("small-llama-bf16")
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    return out


def test_unsupported_cpu_gets_a_clear_error(monkeypatch, small_llama):
    """Without the C kernels (no compiler) the panels GEMM is gone; a CPU without bf16 GEMM
    hardware then has no bf16 GEMM that is not emulated, and bf16 is refused saying why."""
    monkeypatch.delenv("QWORKER_CPU_BF16", raising=False)
    monkeypatch.setenv("QWORKER_CPU_KERNELS", "0")
    if _supported():
        pytest.skip("this CPU has bf16 GEMM hardware (oneDNN's bf16 linear runs without the C kernels)")
    with pytest.raises(ValueError, match="panels GEMM .*C kernels are unavailable.*AVX512_BF16 or AMX"):
        ModelRunner(small_llama, device="cpu", dtype="bfloat16")


def test_bf16_runs_on_the_panels_gemm_without_bf16_hardware(monkeypatch):
    """The panels GEMM widens bf16 weights in registers: bf16 needs no AVX512_BF16/AMX."""
    monkeypatch.delenv("QWORKER_CPU_BF16", raising=False)
    from qworker.model.linear import panels_supported

    if not panels_supported(torch.bfloat16)[0]:
        pytest.skip(f"the panels GEMM is unavailable: {panels_supported(torch.bfloat16)[1]}")
    check_cpu_bf16()  # no error


def test_bf16_logits_follow_fp32(monkeypatch, small_llama, seed):
    if not _supported():
        monkeypatch.setenv("QWORKER_CPU_BF16", "force")  # the emulated (slow) bf16 GEMMs: same numerics
    gen = torch.Generator().manual_seed(seed)
    runners = {dt: ModelRunner(small_llama, device="cpu", dtype=dt) for dt in ("float32", "bfloat16")}
    bf = runners["bfloat16"]
    assert bf.kv_dtype == torch.bfloat16 and bf.model.act_dtype == torch.float32
    assert bf.model.layers[0].qkv.act_dtype == torch.float32
    for r in runners.values():
        r.allocate_kv_cache(num_blocks=8, num_cpu_blocks=0, block_size=16)
    ids = torch.randint(0, 512, (30,), generator=gen).tolist()
    steps = [Batch([SeqChunk(ids[:29], 0, [0, 1], True)]), Batch([SeqChunk(ids[29:30], 29, [0, 1], True)])]
    for step in steps:
        f32, b16 = (runners[d].execute(step) for d in ("float32", "bfloat16"))
        assert b16.dtype == torch.float32 and b16.shape == f32.shape
        torch.testing.assert_close(b16, f32, rtol=0.05, atol=0.05 * f32.abs().max().item())
    assert bf.kv.layers[0][0].dtype == torch.bfloat16
