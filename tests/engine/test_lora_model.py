"""LoRA in the model runner, engine-free: a Batch whose chunks run under different adapter slots
(and the base model) gives each chunk PEFT's logits for its adapter, and a greedy prefill+decode
loop driven through ``ModelRunner.execute`` gives PEFT's greedy tokens.

Adapters are random PEFT adapters (B non-zero) on the real test model: different ranks, target
subsets, rsLoRA and a rank pattern. The stack layout the Triton backend uses is checked against
the CPU grouped path on random slots and segments, and through the Triton kernels under the
interpreter on the tiny model.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random

import pytest
import torch

from qworker.model.batch import Batch, SeqChunk
from qworker.model.lora.adapter import LoRAAdapter, load_lora_adapter
from qworker.model.lora.apply import LoRAStep, apply_grouped, apply_stack, apply_stack_torch
from qworker.model.lora.stack import ProjectionSlots
from qworker.model.runner import ModelRunner
from tests.engine.hf_reference import assert_greedy_matches
from tests.engine.lora_support import ALL_MODULES, make_peft_adapter, peft_logits, peft_reference

PROMPTS = [
    [1, 504, 3458, 314, 2114, 282, 4649, 30, 378, 13],
    [1, 22, 333, 4444, 55, 6],
    [1, 1205, 2771, 28, 253, 4767, 6724, 327, 253],
]
BLOCK = 16
BLOCKS_PER_SEQ = 4


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        "all8": make_peft_adapter(model_dir, root / "all8", rank=8, alpha=16, seed=1, target_modules=ALL_MODULES),
        "qv_down4_rs": make_peft_adapter(model_dir, root / "qv_down4_rs", rank=4, alpha=8, seed=2, use_rslora=True,
                                         target_modules=["q_proj", "v_proj", "down_proj"]),
        "mlp16": make_peft_adapter(model_dir, root / "mlp16", rank=16, alpha=32, seed=3, target_modules=["o_proj", "gate_proj", "up_proj"],
                                   rank_pattern={"layers.3.mlp.up_proj": 2}),
    }


@pytest.fixture(scope="module")
def runner(model_dir):
    r = ModelRunner(model_dir, device="cpu", dtype="float32")
    r.allocate_kv_cache(BLOCKS_PER_SEQ * 8, 0, BLOCK)
    r.enable_lora(max_loras=2, max_rank=16)
    return r


@pytest.fixture(scope="module")
def loaded(adapters, runner):
    return {name: load_lora_adapter(path, runner.config, 16) for name, path in adapters.items()}


def blocks(i: int) -> list[int]:
    return list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))


def test_mixed_batch_logits_match_peft(runner, adapters, loaded, model_dir):
    """Two adapters and the base model in one prefill batch, slot 0 in two separate chunks."""
    runner.set_lora(0, loaded["all8"])
    runner.set_lora(1, loaded["qv_down4_rs"])
    plan = [(PROMPTS[0], 0, "all8"), (PROMPTS[1], -1, None), (PROMPTS[2], 1, "qv_down4_rs"), (PROMPTS[1], 0, "all8"), (PROMPTS[0], 1, "qv_down4_rs")]
    batch = Batch([SeqChunk(p, 0, blocks(i), True, lora_slot=slot) for i, (p, slot, _) in enumerate(plan)])
    logits = runner.execute(batch)
    for row, (prompt, slot, name) in zip(logits, plan):
        ref = peft_logits(model_dir, adapters[name] if name else None, prompt)[-1]
        torch.testing.assert_close(row, ref, rtol=0, atol=2e-3, msg=lambda m: f"slot {slot} ({name}): {m}")
        if name:  # the adapter really moves the output
            assert (ref - peft_logits(model_dir, None, prompt)[-1]).abs().max() > 0.5


def test_greedy_prefill_decode_matches_peft(runner, adapters, loaded, model_dir):
    """A greedy loop over Batches: one prefill step, then decode steps in a shuffled chunk order
    (a slot's rows are not contiguous); slot 0 is re-filled with another adapter first."""
    runner.set_lora(0, loaded["mlp16"])
    runner.set_lora(1, loaded["qv_down4_rs"])
    max_tokens = 8
    plan = [(PROMPTS[0], 0, "mlp16"), (PROMPTS[2], -1, None), (PROMPTS[2], 1, "qv_down4_rs"), (PROMPTS[0], 1, "qv_down4_rs")]
    seqs = [list(p) for p, _, _ in plan]
    out: list[list[int]] = [[] for _ in plan]
    rng = random.Random(0)
    logits = runner.execute(Batch([SeqChunk(p, 0, blocks(i), True, lora_slot=slot) for i, (p, slot, _) in enumerate(plan)]))
    order = list(range(len(plan)))
    for step in range(max_tokens):
        for i, row in zip(order, logits):
            tok = int(row.argmax())
            out[i].append(tok)
            seqs[i].append(tok)
        if step == max_tokens - 1:
            break
        rng.shuffle(order)
        logits = runner.execute(Batch([SeqChunk([seqs[i][-1]], len(seqs[i]) - 1, blocks(i), True, lora_slot=plan[i][1]) for i in order]))
    for i, (prompt, slot, name) in enumerate(plan):
        ref = peft_reference(model_dir, adapters[name] if name else None, prompt, max_tokens)
        assert_greedy_matches(out[i], ref, what=f"sequence {i} ({name or 'base'})")
    assert out[0] != out[3] and out[1] != out[2], "adapters that do not move greedy outputs prove nothing"


def test_cleared_slot_is_the_base_model_and_bad_slots_are_refused(runner, loaded):
    runner.set_lora(1, loaded["all8"])
    chunk = lambda slot: SeqChunk(PROMPTS[1], 0, blocks(0), True, lora_slot=slot)  # noqa: E731
    base = runner.execute(Batch([chunk(-1)]))
    assert (runner.execute(Batch([chunk(1)])) - base).abs().max() > 0.5
    runner.set_lora(1, None)
    assert torch.equal(runner.execute(Batch([chunk(1)])), base)
    with pytest.raises(ValueError, match="slot 2"):
        runner.set_lora(2, loaded["all8"])
    with pytest.raises(ValueError, match="slot 2"):
        runner.execute(Batch([chunk(2)]))
    a, b = loaded["all8"].weights[0, "q_proj"]
    big = LoRAAdapter(rank=32, weights={(0, "q_proj"): (torch.zeros(32, a.shape[1]), torch.zeros(b.shape[0], 32))}, path="big")
    with pytest.raises(ValueError, match="rank 32"):
        runner.set_lora(0, big)
    wrong = LoRAAdapter(rank=8, weights={(0, "q_proj"): (a, b[:10])}, path="wrong")
    with pytest.raises(ValueError, match="q_proj"):
        runner.set_lora(0, wrong)


def test_stack_layout_agrees_with_grouped():
    """Random adapters (ranks < R, some slices untargeted, one slot empty) over random segments
    with repeated slots and base rows: the stack layout's torch loop and, when it imports under
    the Triton interpreter, the SGMV kernels add what the grouped CPU path adds."""
    gen = torch.Generator().manual_seed(0)
    S, R, fin, outs = 3, 8, 24, (16, 8, 8)
    grouped = ProjectionSlots(fin, list(outs), S, R, torch.device("cpu"), torch.float32, "grouped", "matmul")
    stack = ProjectionSlots(fin, list(outs), S, R, torch.device("cpu"), torch.float32, "stack", "matmul")
    for slot, ranks in ((0, (3, None, 8)), (1, (None, 5, None)), (2, (None, None, None))):
        pairs = [None if r is None else (torch.randn(r, fin, generator=gen), torch.randn(o, r, generator=gen)) for r, o in zip(ranks, outs)]
        grouped.set(slot, pairs)
        stack.set(slot, pairs)
    lengths = [1, 1, 5, 1, 3, 1, 2, 4]
    chunk_slots = [0, 1, 0, -1, 1, 2, 0, 0]
    segments = LoRAStep.segments_of(lengths, chunk_slots)
    assert segments[-1] == (12, 6, 0)  # the last two chunks merged
    T = sum(lengths)
    x = torch.randn(T, fin, generator=gen)
    y0 = torch.randn(T, sum(outs), generator=gen)
    expected = y0.clone()
    apply_grouped(grouped, x, expected, LoRAStep(segments, T, torch.device("cpu"), grouped=True))
    assert not torch.equal(expected, y0)
    assert torch.equal(expected[7], y0[7]) and torch.equal(expected[11], y0[11])  # a base row, a row of the empty slot
    y = y0.clone()
    apply_stack_torch(stack, x, y, LoRAStep(segments, T, torch.device("cpu"), grouped=False))
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
    k = _interpreted_sgmv()
    if k is None:
        pytest.skip("kernels.lora_sgmv does not import (no triton): the kernel path is checked in tests/kernels")
    y = y0.clone()
    import qworker.model.lora.apply as apply_mod

    saved, apply_mod._kernels = apply_mod._kernels, k
    try:
        apply_stack(stack, x, y, LoRAStep(segments, T, torch.device("cpu"), grouped=False))
    finally:
        apply_mod._kernels = saved
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)


def _interpreted_sgmv():
    """``kernels.lora_sgmv`` as the Triton interpreter runs it on CPU (None without triton)."""
    if torch.cuda.is_available():
        return importlib.import_module("kernels.lora_sgmv")
    if importlib.util.find_spec("triton") is None:
        return None
    os.environ["TRITON_INTERPRET"] = "1"  # read when a kernel is defined: reload if imported compiled
    mod = importlib.import_module("kernels.lora_sgmv")
    return importlib.reload(mod)


def test_triton_backend_matches_peft_on_the_tiny_model(tiny_model_dir, tmp_path):
    """The Triton backend (SGMV kernels and the attention kernels, interpreted on CPU) with an
    adapter and the base model in one batch, prefill then two decode steps."""
    k = _interpreted_sgmv()
    if k is None:
        pytest.skip("triton is not installed")
    import qworker.model.lora.apply as apply_mod

    adapter = make_peft_adapter(tiny_model_dir, tmp_path / "a", rank=4, alpha=8, seed=5, target_modules=ALL_MODULES, b_std=0.2)
    if not torch.cuda.is_available():  # the attention kernels too, interpreted
        for name in ("kernels.kv_store", "kernels.decode_attention", "kernels.prefill_attention", "kernels.rmsnorm"):
            importlib.reload(importlib.import_module(name))
    r = ModelRunner(tiny_model_dir, device="cpu", dtype="float32", kernel_backend="triton")
    r.allocate_kv_cache(8, 0, BLOCK)
    r.enable_lora(max_loras=2, max_rank=8)
    r.set_lora(1, load_lora_adapter(adapter, r.config, 8))
    saved, apply_mod._kernels = apply_mod._kernels, k
    try:
        seqs = [list(PROMPTS[0]), list(PROMPTS[2]), list(PROMPTS[1])]
        slots = [1, -1, 1]
        chunks = [SeqChunk(s, 0, [2 * i, 2 * i + 1], True, lora_slot=slot) for i, (s, slot) in enumerate(zip(seqs, slots))]
        for step in range(3):
            logits = r.execute(Batch(chunks))
            for i, (s, slot) in enumerate(zip(seqs, slots)):
                ref = peft_logits(tiny_model_dir, adapter if slot >= 0 else None, s)[-1]
                torch.testing.assert_close(logits[i], ref, rtol=0, atol=1e-3)
                s.append(int(ref.argmax()))
            chunks = [SeqChunk([s[-1]], len(s) - 1, [2 * i, 2 * i + 1], True, lora_slot=slot) for i, (s, slot) in enumerate(zip(seqs, slots))]
        assert (peft_logits(tiny_model_dir, adapter, seqs[0])[-1] - peft_logits(tiny_model_dir, None, seqs[0])[-1]).abs().max() > 0.05
    finally:
        apply_mod._kernels = saved
