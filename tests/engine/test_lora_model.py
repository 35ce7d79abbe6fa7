"""LoRA in the model runner, engine-free: a Batch whose chunks run under different adapter slots
(and the base model) gives each chunk PEFT's logits for its adapter, and a greedy prefill+decode
loop driven through ``ModelRunner.execute`` gives PEFT's greedy tokens (checked teacher-forced,
see ``assert_peft_greedy``). Each test's PEFT references come from one mixed-adapter PEFT forward
over all its sequences (``peft_logits_many``).

Adapters are random PEFT adapters (B non-zero) on the real test model: different ranks, target
subsets, rsLoRA and a rank pattern. The CPU grouped path is checked against the stack layout
the Triton backend uses on random slots and segments; the Triton kernels themselves run through
the model under the interpreter in tests/kernels/test_lora_model_backends.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from qworker.model.batch import Batch, SeqChunk
from qworker.model.lora.adapter import LoRAAdapter, load_lora_adapter
from qworker.model.lora.apply import LoRAStep, apply_grouped, apply_stack_torch
from qworker.model.lora.stack import ProjectionSlots
from qworker.model.runner import ModelRunner
from tests.engine.lora_support import ALL_MODULES, assert_peft_greedy_many, make_peft_adapter, peft_logits_many

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
    refs = peft_logits_many(model_dir, [(adapters[name] if name else None, prompt) for prompt, _, name in plan])
    for row, ref, (prompt, slot, name) in zip(logits, refs, plan):
        torch.testing.assert_close(row, ref[-1], rtol=0, atol=2e-3, msg=lambda m: f"slot {slot} ({name}): {m}")
    # the adapters really move the output: one prompt under base vs adapter, and under two adapters
    assert (logits[3] - logits[1]).abs().max() > 0.5 and (logits[0] - logits[4]).abs().max() > 0.5


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
    assert_peft_greedy_many(model_dir, [(adapters[name] if name else None, prompt, out[i], f"sequence {i} ({name or 'base'})")
                                        for i, (prompt, slot, name) in enumerate(plan)])
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


STEP_PLANS = {
    # (chunk lengths, chunk slots): the grouped path per slot (slices and a gather)
    "prefill": ([1, 1, 5, 1, 3, 1, 2, 4], [0, 1, 0, -1, 1, 2, 0, 0]),
    # the batched (padded) path: base rows, every row under an adapter, a subset of the slots
    "decode": ([1] * 12, [0, 1, 2, 0, 1, -1, 2, 0, 1, 2, 0, -1]),
    "decode_full": ([1] * 6, [0, 1, 0, 1, 2, 2]),
    "decode_subset": ([1] * 6, [0, 2, 0, 2, -1, 0]),
    # long segments alone beside a few short rows (read, added and written back by index)
    "mixed": ([1, 20, 1, 17, 1, 3, 2], [0, 1, 2, 0, -1, 1, 1]),
    "long": ([16, 30, 1], [0, 1, -1]),
}


def _grouped_slots(fin, outs, S, R, packed: bool) -> ProjectionSlots:
    """The grouped layout on the C GEMM (``packed``) or on torch's (where the C kernels are missing)."""
    slots = ProjectionSlots(fin, list(outs), S, R, torch.device("cpu"), torch.float32, "grouped")
    if packed and slots.packed is None:
        pytest.skip("the C GEMM is unavailable here (no compiler or QWORKER_CPU_KERNELS=0)")
    if not packed:
        slots.packed = None
    return slots


@pytest.mark.parametrize("packed", [True, False], ids=["c-gemm", "torch"])
@pytest.mark.parametrize("plan", STEP_PLANS)
def test_stack_layout_agrees_with_grouped(plan, packed):
    """Random adapters (ranks < R, some slices untargeted, one slot empty) over segments with
    repeated slots and base rows: the grouped CPU path (per slot on the C GEMM; without it, per
    slot or batched over padded stacks) adds exactly the stack layout's per-segment products (the
    Triton kernels' contract; the kernels themselves run in tests/kernels/test_lora_model_backends.py)."""
    gen = torch.Generator().manual_seed(0)
    S, R, fin, outs = 3, 8, 24, (16, 8, 8)
    grouped = _grouped_slots(fin, outs, S, R, packed)
    stack = ProjectionSlots(fin, list(outs), S, R, torch.device("cpu"), torch.float32, "stack")
    empty = 2 if plan in ("prefill", "mixed") else None
    for slot, ranks in ((0, (3, None, 8)), (1, (None, 5, None)), (2, (None, None, None) if empty == 2 else (2, 2, 2))):
        pairs = [None if r is None else (torch.randn(r, fin, generator=gen), torch.randn(o, r, generator=gen)) for r, o in zip(ranks, outs)]
        grouped.set(slot, pairs)
        stack.set(slot, pairs)
    lengths, chunk_slots = STEP_PLANS[plan]
    segments = LoRAStep.segments_of(lengths, chunk_slots)
    T = sum(lengths)
    x = torch.randn(T, fin, generator=gen)
    y0 = torch.randn(T, sum(outs), generator=gen)
    step = LoRAStep(segments, T, torch.device("cpu"), grouped=True, max_loras=S)
    assert (step.padded is not None) == (plan != "long")
    assert (step.padded is not None and step.padded.where is not None) == (plan in ("prefill", "decode", "decode_full", "decode_subset"))
    assert bool(step.long) == (plan in ("mixed", "long"))
    y = y0.clone()
    apply_grouped(grouped, x, y, step)
    expected = y0.clone()
    apply_stack_torch(stack, x, expected, LoRAStep(segments, T, torch.device("cpu"), grouped=False))
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)
    for row, slot in enumerate(s for n, s in zip(lengths, chunk_slots) for _ in range(n)):
        moved = not torch.equal(y[row], y0[row])
        assert moved == (slot >= 0 and slot != empty), f"row {row} (slot {slot})"
    if plan == "prefill":
        assert segments[-1] == (12, 6, 0)  # the last two chunks merged


@pytest.mark.parametrize("packed", [True, False], ids=["c-gemm", "torch"])
def test_slot_rewrites_keep_the_layouts_in_step(packed):
    """Adapters replaced, cleared and refilled in place (ranks growing past the padded width,
    then smaller again): after every write both layouts still add the same products."""
    gen = torch.Generator().manual_seed(1)
    S, R, fin, outs = 3, 8, 24, (16, 8, 8)
    grouped = _grouped_slots(fin, outs, S, R, packed)
    stack = ProjectionSlots(fin, list(outs), S, R, torch.device("cpu"), torch.float32, "stack")
    lengths, chunk_slots = STEP_PLANS["decode"]
    segments = LoRAStep.segments_of(lengths, chunk_slots)
    T = sum(lengths)
    x = torch.randn(T, fin, generator=gen)
    writes = [(0, (2, None, 2)), (1, (3, 3, None)), (2, (None, None, 1)), (1, (8, None, 6)), (0, None), (2, (1, 1, 1)), (0, (4, 4, 4))]
    for slot, ranks in writes:
        pairs = [None] * 3 if ranks is None else [
            None if r is None else (torch.randn(r, fin, generator=gen), torch.randn(o, r, generator=gen)) for r, o in zip(ranks, outs)]
        grouped.set(slot, pairs)
        stack.set(slot, pairs)
        y, expected = torch.zeros(T, sum(outs)), torch.zeros(T, sum(outs))
        apply_grouped(grouped, x, y, LoRAStep(segments, T, torch.device("cpu"), grouped=True, max_loras=S))
        apply_stack_torch(stack, x, expected, LoRAStep(segments, T, torch.device("cpu"), grouped=False))
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4, msg=lambda m: f"after writing slot {slot} {ranks}: {m}")


def test_an_adapter_rows_delta_does_not_depend_on_the_step():
    """On the C GEMM, a row's LoRA delta has the same bits alone, as one row of a longer segment
    (a speculative verify chunk), and beside other adapters' and base rows (helper-59: torch's
    GEMMs changed it with the segment's length, and greedy tokens with speculation on)."""
    gen = torch.Generator().manual_seed(2)
    S, R, fin, outs = 3, 16, 64, (48, 16, 16)
    slots = _grouped_slots(fin, outs, S, R, True)
    for slot, r in ((0, 16), (1, 4), (2, 8)):
        slots.set(slot, [(torch.randn(r, fin, generator=gen), torch.randn(o, r, generator=gen)) for o in outs])
    x = torch.randn(40, fin, generator=gen)

    def delta(lengths, chunk_slots, row):
        T = sum(lengths)
        y = torch.zeros(T, sum(outs))
        apply_grouped(slots, x[:T], y, LoRAStep(LoRAStep.segments_of(lengths, chunk_slots), T, torch.device("cpu"), grouped=True, max_loras=S))
        return y[row]

    alone = delta([1], [0], 0)
    for lengths, chunk_slots in (([6], [0]), ([1, 5], [0, 1]), ([1, 3, 20, 16], [0, -1, 2, 0]), ([1, 1, 1], [0, 1, 0])):
        assert torch.equal(delta(lengths, chunk_slots, 0), alone), (lengths, chunk_slots)


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3_moe", "glm", "glm4", "cohere", "phi", "starcoder2", "stablelm", "nemotron",
                                    "llama_mlp_bias", "arcee", "gpt_oss", "glm4_moe", "dots1", "llama4_text", "hunyuan_v1_dense", "ernie4_5",
                                    "helium"])
def test_general_forward_families_match_peft(family, family_models, tmp_path):
    """The decoder's general forward (Gemma 3: q/k norms, sandwich norms, the GELU MLP object's
    own projections; Qwen3-MoE: MoE layers beside a dense one, attention LoRA; GLM-4: sandwich
    norms; GLM, GLM-4 and Cohere: q/k rows reordered at load, so q/k's B rows too; Cohere, Phi:
    parallel blocks; Phi, StarCoder 2: LayerNorm, non-gated MLPs, biases; StableLM: per-head q/k
    norms; Hunyuan: q/k norms after the rotation; ERNIE 4.5, Helium: interleaved rotary, q/k rows
    reordered) with an adapter and the base model in one prefill batch, then one decode step."""
    model_dir = family_models.get(family)
    # PEFT would put MLP targets of a MoE model on its experts' parameters (target_parameters), which
    # the loader refuses: attention only there; GLM fuses gate and up
    # (gate_up_proj: not a LoRA target here), Phi and StarCoder 2 name their MLPs (and Phi its o) otherwise,
    # Nemotron's MLP is not gated (its up_proj/down_proj are not LoRA targets here)
    modules = {"qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"], "glm": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
               "glm4": ["q_proj", "k_proj", "o_proj", "down_proj"], "phi": ["q_proj", "k_proj", "v_proj"],
               "starcoder2": ["q_proj", "k_proj", "v_proj", "o_proj"], "nemotron": ["q_proj", "v_proj", "o_proj"], "arcee": ["q_proj", "k_proj", "v_proj", "o_proj"],
               "gpt_oss": ["q_proj", "k_proj", "v_proj", "o_proj"], "glm4_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
               "dots1": ["q_proj", "k_proj", "v_proj", "o_proj"], "llama4_text": ["q_proj", "k_proj", "v_proj", "o_proj"]}.get(family, ALL_MODULES)
    adapter = make_peft_adapter(model_dir, tmp_path / family, rank=4, alpha=8, seed=9, target_modules=modules, b_std=0.3)
    r = ModelRunner(model_dir, device="cpu", dtype="float32")
    r.allocate_kv_cache(8, 0, BLOCK)
    r.enable_lora(max_loras=1, max_rank=4)
    loaded = load_lora_adapter(adapter, r.config, 4)
    r.set_lora(0, loaded)
    seqs = [list(PROMPTS[0]), list(PROMPTS[0])]
    slots = [0, -1]
    chunks = [SeqChunk(s, 0, [2 * i, 2 * i + 1], True, lora_slot=slot) for i, (s, slot) in enumerate(zip(seqs, slots))]
    for _ in range(2):
        logits = r.execute(Batch(chunks))
        refs = peft_logits_many(model_dir, [(adapter if slot >= 0 else None, s) for s, slot in zip(seqs, slots)])
        for i, (s, slot, ref) in enumerate(zip(seqs, slots, refs)):
            torch.testing.assert_close(logits[i], ref[-1], rtol=0, atol=1e-3, msg=lambda m: f"{family} slot {slot}: {m}")
            s.append(int(ref[-1].argmax()))
        chunks = [SeqChunk([s[-1]], len(s) - 1, [2 * i, 2 * i + 1], True, lora_slot=slot) for i, (s, slot) in enumerate(zip(seqs, slots))]
    assert (logits[0] - logits[1]).abs().max() > 0.05
