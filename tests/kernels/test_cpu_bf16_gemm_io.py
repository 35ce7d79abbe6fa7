"""CPU bf16 mode without fp32 copies around the bf16 GEMMs: the C kernels that read a GEMM's bf16
output or write its bf16 input (residual add + RMSNorm with a bf16 ``out``, SwiGLU bf16 -> bf16)
give exactly the old path's values (fp32 kernel, then ``.to(torch.bfloat16)``), under every ISA
build; their torch fallbacks agree to bf16 rounding; and the model's bf16 loop gives the same
logits as the fp32-activation loop, which it still takes when a projection is wrapped (LoRA, TP)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from cpu_isa import isa  # noqa: F401  (fixture)
from kernel_testlib import generator

from kernels import rms_norm_bf16_out_cpu, rms_norm_cpu, silu_and_mul_cpu

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on this machine")
bf16 = torch.bfloat16


def _norm_inputs(seed, rows, x_dtype, with_residual):
    gen = generator(seed)
    x = (torch.randn(rows, 576, generator=gen) * 3).to(x_dtype)
    res = torch.randn(rows, 576, generator=gen) if with_residual else None
    return x, torch.randn(576, generator=gen), res


@pytest.mark.parametrize("rows", [1, 7, 300])  # 300: the multi-threaded path
@pytest.mark.parametrize("x_dtype", [torch.float32, bf16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_with_bf16_out_is_the_fp32_kernel_rounded(isa, seed, rows, x_dtype, with_residual):  # noqa: F811
    x, w, res = _norm_inputs(seed, rows, x_dtype, with_residual)
    x0, res0 = x.clone(), None if res is None else res.clone()
    out, new_res = rms_norm_bf16_out_cpu(x, w, 1e-5, res)
    ref_out, ref_res = rms_norm_cpu(x.float(), w, 1e-5, None if res is None else res)
    assert out.dtype == bf16 and new_res.dtype == torch.float32, "the residual stream stays fp32"
    assert torch.equal(new_res, ref_res)
    assert torch.equal(out, ref_out.to(bf16))
    assert torch.equal(x, x0) and (res is None or torch.equal(res, res0)), "inputs must be left untouched"


@pytest.mark.parametrize("T", [1, 100])
def test_silu_and_mul_bf16_is_the_fp32_kernel_rounded(isa, seed, T):  # noqa: F811
    gen = generator(seed)
    gate_up = (torch.randn(T, 2 * 1536, generator=gen) * 8).to(bf16)  # wide range: both exp branches
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    out = silu_and_mul_cpu(gate_up)
    assert out.dtype == bf16 and out.shape == (T, 1536)
    assert torch.equal(out, silu_and_mul_cpu(gate_up.float()).to(bf16))


def test_fallbacks_without_the_library_agree(monkeypatch, seed):
    """QWORKER_CPU_KERNELS=0: the torch references, in fp32 and rounded once, within bf16 rounding."""
    x, w, res = _norm_inputs(seed, 9, bf16, True)
    g = (torch.randn(5, 64, generator=generator(seed)) * 4).to(bf16)
    c_norm, c_silu = rms_norm_bf16_out_cpu(x, w, 1e-5, res), silu_and_mul_cpu(g)
    monkeypatch.setenv("QWORKER_CPU_KERNELS", "0")
    ref_out, ref_res = rms_norm_bf16_out_cpu(x, w, 1e-5, res)
    assert ref_out.dtype == bf16 and ref_res.dtype == torch.float32
    torch.testing.assert_close(ref_res, c_norm[1], rtol=0, atol=0)
    torch.testing.assert_close(ref_out.float(), c_norm[0].float(), rtol=8e-3, atol=1e-5)
    ref_silu = silu_and_mul_cpu(g)
    assert ref_silu.dtype == bf16
    torch.testing.assert_close(ref_silu.float(), c_silu.float(), rtol=8e-3, atol=1e-5)


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True)
    out = tmp_path_factory.mktemp("small-llama-bf16-io")
    LlamaForCausalLM(config).eval().save_pretrained(out, safe_serialization=True)
    return out


def test_model_bf16_loop_gives_the_fp32_activation_loops_logits(monkeypatch, small_llama, seed):
    from qworker.model.batch import Batch, SeqChunk
    from qworker.model.decoder import DecoderModel
    from qworker.model.linear import check_cpu_bf16
    from qworker.model.runner import ModelRunner

    try:
        check_cpu_bf16()
    except ValueError:
        monkeypatch.setenv("QWORKER_CPU_BF16", "force")  # the emulated bf16 GEMMs: the same comparison
    r = ModelRunner(small_llama, device="cpu", dtype="bfloat16")
    m = r.model
    assert m.forward.__func__ is DecoderModel._forward_cpu_bf16
    r.allocate_kv_cache(num_blocks=8, num_cpu_blocks=0, block_size=16)
    ids = torch.randint(0, 512, (30,), generator=generator(seed)).tolist()
    steps = [Batch([SeqChunk(ids[:29], 0, [0, 1], True)]), Batch([SeqChunk(ids[29:], 29, [0, 1], True)])]
    new = [r.execute(s) for s in steps]
    assert all(t.dtype == torch.float32 and t.shape == (1, 512) for t in new)

    seen = []  # a wrapped projection (as LoRA and TP wrap them) must get the fp32-activation loop
    inner = m.layers[1].gate_up
    m.layers[1].gate_up = lambda x: (seen.append(x.dtype), inner(x))[1]
    wrapped = [r.execute(s) for s in steps]
    assert seen == [torch.float32, torch.float32]
    m.layers[1].gate_up = inner

    m.forward = lambda *a: DecoderModel.forward(m, *a)
    old = [r.execute(s) for s in steps]
    for a, b, c in zip(new, wrapped, old):
        assert torch.equal(a, c) and torch.equal(b, c)
