"""The plain CPU forward in one C call (kernels/decoder_cpu.py) against the Python layer loop, in
fp32 and in the CPU bf16 mode: bit for bit the same logits and the same K/V writes, step by step,
over prefill, decode and mixed steps, prefix hits, fp32/bf16/fp16 caches, a sliding window and
q/k/v biases; and the cases where it must stand aside (projections wrapped after the model was
built, kernels off, inputs not covered)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels import cpu as kcpu
from qworker.engine import EngineConfig, LLMEngine
from qworker.model.linear import Linear
from tests.engine.engine_support import BLOCK_BYTES_TINY, dirty, greedy, rand_ids, run
from tests.engine.family_models import build_family_model

pytestmark = pytest.mark.skipif(not kcpu.cpu_kernels_available(), reason="no C compiler for the CPU kernels")


@pytest.fixture(autouse=True)
def panels(monkeypatch):
    """The fused loop needs the panels GEMM; the start-up timing may pick another path (x @ w for
    the tiny models, oneDNN on some CPUs)."""
    monkeypatch.setenv("QWORKER_CPU_LINEAR", "panels")


class Compare:
    """Wraps ``runner.execute``: each step runs the Python loop, then (K/V restored) the fused
    call, and requires equal logits and equal caches."""

    def __init__(self, e: LLMEngine):
        self.e, self.model, self.real = e, e.runner.model, e.runner.execute
        self.steps = self.fused = 0
        bound = self.model.fused_layers
        real_run = bound.run

        def counting(*a, **kw):
            out = real_run(*a, **kw)
            self.fused += out is not None
            return out

        bound.run = counting
        e.runner.execute = self

    def __call__(self, batch):
        for c in batch.chunks:  # full logits rows, not greedy one-hots: the comparison sees every value
            c.argmax_only = False
        kv = self.e.runner.kv.layers
        before = [(k.clone(), v.clone()) for k, v in kv]
        self.model.fused_cpu_forward = False
        want = self.real(batch)
        want_kv = [(k.clone(), v.clone()) for k, v in kv]
        for (k, v), (k0, v0) in zip(kv, before):
            k.copy_(k0)
            v.copy_(v0)
        self.model.fused_cpu_forward = True
        got = self.real(batch)
        self.steps += 1
        assert torch.equal(got, want), f"step {self.steps}: logits differ by {(got - want).abs().max().item()}"
        for layer, ((k, v), (k1, v1)) in enumerate(zip(kv, want_kv)):
            assert torch.equal(k, k1) and torch.equal(v, v1), f"step {self.steps}: layer {layer}'s cache differs"
        return got


def _mixed_workload(e: LLMEngine, seed: int, n: int = 7):
    rng = random.Random(seed)
    shared = rand_ids(rng, 40)  # a common prefix: later requests hit the prefix cache
    for i in range(n):
        prompt = (shared if i % 2 else []) + rand_ids(rng, rng.randrange(1, 90))
        e.add_request(f"r{i}", prompt, greedy(rng.randrange(1, 12)))
    return run(e)


@pytest.mark.parametrize("dtype,kv_cache_dtype", [("float32", "auto"), ("float32", "bfloat16"), ("float32", "float16"),
                                                  ("bfloat16", "auto"), ("bfloat16", "float32")])
def test_identical_to_the_python_loop(tiny_model_dir, dtype, kv_cache_dtype):
    """fp32, and the CPU bf16 mode (bf16 weights and GEMM inputs/outputs, fp32 residual stream and
    attention: the C loop against DecoderModel._forward_cpu_bf16's loop)."""
    e = dirty(LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                     max_num_batched_tokens=64, enable_prefix_caching=True,
                                     kv_cache_memory=128 * BLOCK_BYTES_TINY)))
    assert e.runner.model.fused_layers is not None
    assert e.runner.model.fused_layers.weight_dtype == getattr(torch, dtype)
    c = Compare(e)
    done = _mixed_workload(e, seed=1)
    assert len(done) == 7 and all(r.error_code is None for r in done.values())
    # every step went through the C loop (prefill chunks of 64 tokens mix with decodes)
    assert c.steps > 10 and c.fused == c.steps


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_identical_on_the_real_model(model_dir, dtype):
    e = LLMEngine(EngineConfig(model=str(model_dir), dtype=dtype, kv_cache_memory=64 << 20, max_num_batched_tokens=96))
    c = Compare(e)
    done = _mixed_workload(e, seed=2, n=5)
    assert len(done) == 5 and c.steps > 5 and c.fused == c.steps


@pytest.mark.parametrize("model_type,overrides,dtype", [("mistral", {}, "float32"),
                                                        ("qwen2", {"use_sliding_window": False}, "float32"),
                                                        ("qwen2", {"use_sliding_window": False}, "bfloat16")],
                         ids=["mistral-window", "qwen2-biases", "qwen2-biases-bf16"])
def test_identical_with_a_window_or_biases(tmp_path, model_dir, model_type, overrides, dtype):
    """Mistral's sliding window (one for all layers: the plain loop) and Qwen2's q/k/v biases."""
    path = build_family_model(model_type, tmp_path / model_type, model_dir, **overrides)
    e = dirty(LLMEngine(EngineConfig(model=str(path), dtype=dtype, kv_cache_memory=8 << 20, max_num_batched_tokens=48)))
    assert e.runner.model.fused_layers is not None
    c = Compare(e)
    done = _mixed_workload(e, seed=3, n=5)
    assert len(done) == 5 and c.steps > 5 and c.fused == c.steps


def test_stands_aside_for_wrapped_projections_and_kernels_off(tiny_model_dir, monkeypatch):
    e = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=64 * BLOCK_BYTES_TINY))
    model = e.runner.model
    c = Compare(e)
    layer = model.layers[1]
    real = layer.o

    class Timed:  # what a benchmark's timer or an adapter wrapper does
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def __call__(self, x):
            self.calls += 1
            return self.inner(x)

    layer.o = Timed(real)
    e.add_request("a", list(range(100, 130)), greedy(3))
    run(e)
    assert c.fused == 0 and layer.o.calls > 0  # the Python loop ran, through the wrapper
    layer.o = real
    # a Linear replaced by another (new weights): the bound pointers are stale, so not fused either
    layer.o = Linear(real.dense_out_in(), None, model.linear_backend)
    e.add_request("b", list(range(100, 130)), greedy(3))
    run(e)
    assert c.fused == 0
    layer.o = real
    monkeypatch.setattr(kcpu, "EXTEND_KERNEL", False)  # prefill rows on the torch reference: the Python loop
    e.add_request("c", list(range(200, 230)), greedy(1))
    run(e)
    assert c.fused == 0
    monkeypatch.setattr(kcpu, "EXTEND_KERNEL", True)
    steps = c.steps
    e.add_request("d", list(range(300, 330)), greedy(2))
    run(e)
    assert c.fused == c.steps - steps == 2  # back on the C loop: a prefill step and a decode step


def test_bad_slot_raises_like_the_kernels(tiny_model_dir):
    """A slot outside the cache: IndexError from the C loop, as store_kv_cpu raises it."""
    e = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=64 * BLOCK_BYTES_TINY))
    model = e.runner.model
    T = 3
    h = torch.randn(T, model.embed.shape[1])
    k0 = e.runner.kv.layers[0][0]
    slots = torch.tensor([0, 1, k0.shape[0] * k0.shape[1]], dtype=torch.int64)
    with pytest.raises(IndexError, match="slot"):
        model.fused_layers.run(h, torch.arange(T), e.runner.kv.layers, slots,
                               torch.zeros(1, 4, dtype=torch.int32), torch.tensor([T], dtype=torch.int32),
                               torch.tensor([0, T], dtype=torch.int32), 0)
    tables = torch.tensor([[0, 10**6]], dtype=torch.int32)  # a block outside the pool
    with pytest.raises(IndexError, match="block"):
        model.fused_layers.run(torch.randn(1, model.embed.shape[1]), torch.tensor([20]), e.runner.kv.layers,
                               torch.tensor([5], dtype=torch.int64), tables, torch.tensor([21], dtype=torch.int32),
                               torch.tensor([0, 1], dtype=torch.int32), 1)


def test_uncovered_inputs_return_none(tiny_model_dir):
    e = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=64 * BLOCK_BYTES_TINY))
    bound, kv = e.runner.model.fused_layers, e.runner.kv.layers
    H = e.runner.model.embed.shape[1]
    args = dict(slot_mapping=torch.tensor([0], dtype=torch.int64), block_tables=torch.zeros(1, 2, dtype=torch.int32),
                seq_lens=torch.tensor([1], dtype=torch.int32), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                num_decodes=0)
    assert bound.run(torch.randn(1, H), torch.tensor([0]), kv, **args) is not None
    assert bound.run(torch.randn(1, H).double(), torch.tensor([0]), kv, **args) is None  # not fp32
    assert bound.run(torch.randn(1, H), torch.tensor([0], dtype=torch.int32), kv, **args) is None  # positions not int64
    assert bound.run(torch.randn(1, H), torch.tensor([0]), kv[:1], **args) is None  # not one cache per layer
    bad = dict(args, block_tables=torch.zeros(1, 4, dtype=torch.int32)[:, ::2])  # a column-strided table
    assert bound.run(torch.randn(1, H), torch.tensor([0]), kv, **bad) is None


def _step_inputs(model, T: int):
    H = model.embed.shape[1]
    return torch.randn(T, H), torch.arange(T, dtype=torch.int64)


def test_metadata_that_disagrees_with_the_rows_is_refused(tiny_model_dir):
    """Review regression: 12 decode sequences over a 1-row step made the C decode write 12 rows
    into a 1-row buffer (heap corruption); extend rows ending before or after T likewise."""
    e = LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=64 * BLOCK_BYTES_TINY))
    bound, kv = e.runner.model.fused_layers, e.runner.kv.layers
    h, pos = _step_inputs(e.runner.model, 1)
    B = 12
    common = dict(slot_mapping=torch.tensor([0], dtype=torch.int64), block_tables=torch.zeros(B, 1, dtype=torch.int32),
                  seq_lens=torch.ones(B, dtype=torch.int32))
    assert bound.run(h, pos, kv, query_start_loc=torch.arange(B + 1, dtype=torch.int32), num_decodes=B, **common) is None
    h3, pos3 = _step_inputs(e.runner.model, 3)
    one = dict(slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int64), block_tables=torch.zeros(1, 1, dtype=torch.int32),
               seq_lens=torch.tensor([3], dtype=torch.int32))
    for last in (2, 4):  # the extend rows must end at T = 3
        assert bound.run(h3, pos3, kv, query_start_loc=torch.tensor([0, last], dtype=torch.int32), num_decodes=0, **one) is None
    assert bound.run(h3, pos3, kv, query_start_loc=torch.tensor([0, 3], dtype=torch.int32), num_decodes=0, **one) is not None


@pytest.mark.parametrize("change", ["norm replaced", "bias replaced", "weight storage swapped", "rope table replaced"])
def test_any_bound_tensor_changed_turns_it_off(tmp_path, model_dir, change):
    """Review regression: the guard checked only the projections and their weight objects, so a
    replaced norm or bias, or `.data =` on a weight (its old storage freed under the C loop), kept
    the C loop on with stale addresses. Now the Python loop runs, with the new tensors."""
    path = build_family_model("qwen2", tmp_path / "qwen2", model_dir, use_sliding_window=False)
    e = LLMEngine(EngineConfig(model=str(path), kv_cache_memory=8 << 20))
    model = e.runner.model
    c = Compare(e)
    layer = model.layers[0]
    if change == "norm replaced":
        layer.post_norm = layer.post_norm * 2
    elif change == "bias replaced":
        layer.qkv.bias = layer.qkv.bias + 1
    elif change == "weight storage swapped":
        layer.o.weight.data = layer.o.weight.clone()
    else:
        model.rope.cos = model.rope.cos.clone()
    e.add_request("a", list(range(100, 120)), greedy(3))
    run(e)
    assert c.steps == 3 and c.fused == 0
