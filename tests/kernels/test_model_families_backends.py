"""Each family's forward on the Triton kernels (CUDA's path; here under the interpreter on CPU)
equals its forward on the CPU backend, through the real model runner on the family's tiny random
model: sliding windows and soft-caps in the Triton attention kernels, the fused MoE, q/k norms
and per-layer rope tables on that path. One mixed step of decodes and a prefill chunk continuing
a cached prefix that reaches past the windows.

The interpreter runs every Triton program in Python (milliseconds each, one per row for the
norms and rope), so the sequences are short: windows are narrowed to 8 tokens and pages to 8, so
that 20-30 tokens still reach past every window and over several pages. Long contexts over
several attention tiles are the kernel tests' job (tests/kernels)."""

from __future__ import annotations

import pytest
import torch

from qworker.model.batch import Batch, SeqChunk
from qworker.model.runner import ModelRunner
from tests.engine.family_models import build_family_model, family_config

VOCAB = 512
WINDOW, PAGE = 8, 8
# one family per hook on the Triton path (the plain Llama loop is tests/kernels/test_model_backends.py):
# soft-caps + windows, q/k head norms + two rope tables, MoE (fp32 and act-dtype routing weights),
# full-width q/k norms + clip, partial rotary + a global window, no pre-norms + per-type rope with
# yarn (OLMo 3), residual and logit scales (Granite), a shared expert (Qwen2-MoE), no pre-norms with
# per-head q/k norms and NoPE layers (EXAONE 4; SmolLM3's NoPE is the same hook), q/k norms after the
# rotation (Hunyuan), interleaved rotary with a softmax router's choice bias (ERNIE 4.5 MoE), a sigmoid
# router with full-width q/k norms and partial rotary (MiniMax-M2)
CASES = ["gemma2", "gemma3_text", "mixtral", "qwen3_moe", "olmoe", "phi3", "olmo3", "granite", "qwen2_moe", "exaone4", "glm4", "phi", "stablelm", "cohere2", "starcoder2", "gpt_neox", "nemotron", "gpt2", "gpt_bigcode", "granitemoeshared", "llama_mlp_bias", "olmo", "gptj", "opt", "gpt_oss", "glm4_moe", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "dots1", "llama4_text", "hunyuan_v1_dense", "ernie4_5_moe", "minimax_m2", "falcon", "phimoe"]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("family-backends")
    return {f: build_family_model(f, root / f, model_dir, vocab_size=VOCAB, **narrow_window(f)) for f in CASES}


def narrow_window(model_type: str) -> dict:
    """A family's window, if it has one, narrowed to ``WINDOW`` tokens."""
    return {"sliding_window": WINDOW} if getattr(family_config(model_type), "sliding_window", None) else {}


@pytest.mark.parametrize("model_type", CASES)
def test_triton_backend_matches_cpu_backend(family_dirs, model_type, seed, device):
    gen = torch.Generator().manual_seed(seed)
    path = family_dirs[model_type]
    runners = {b: ModelRunner(path, device=str(dev), dtype="float32", kernel_backend=b)
               for b, dev in (("cpu", torch.device("cpu")), ("triton", device))}
    for r in runners.values():
        r.allocate_kv_cache(num_blocks=16, num_cpu_blocks=0, block_size=PAGE)
    lens = {"a": 20, "b": 5, "c": 30}  # a and c past every window, over 3 and 4 pages
    ids = {k: torch.randint(3, VOCAB, (n + 1,), generator=gen).tolist() for k, n in lens.items()}
    pages = torch.randperm(16, generator=gen).tolist()
    tables = {"a": pages[0:3], "b": pages[3:4], "c": pages[4:8]}
    step1 = Batch([SeqChunk(ids["a"][:20], 0, tables["a"], True), SeqChunk(ids["b"][:5], 0, tables["b"], True),
                   SeqChunk(ids["c"][:19], 0, tables["c"], False)])
    step2 = Batch([SeqChunk(ids["a"][20:21], 20, tables["a"], True), SeqChunk(ids["b"][5:6], 5, tables["b"], True),
                   SeqChunk(ids["c"][19:30], 19, tables["c"], True)])
    for step in (step1, step2):
        cpu, triton = (runners[b].execute(step).cpu() for b in ("cpu", "triton"))
        assert cpu.shape == triton.shape == (sum(c.needs_logits for c in step.chunks), VOCAB)
        torch.testing.assert_close(triton, cpu, rtol=1e-4, atol=1e-4)
