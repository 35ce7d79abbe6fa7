"""Every supported family against transformers' own model (fp32, eager attention) on the same
tiny random checkpoint (:mod:`tests.engine.family_models`): greedy outputs token for token on
prompts longer than every window, under preemption (swap and recompute), chunked prefill and
prefix-cache hits, and with forks and n-gram speculation (whole prompts prefilled in one step);
logits close after a mixed prefill/decode step. A divergence is allowed only where transformers'
own top-2 logprobs are within 1e-3 (``assert_greedy_matches``). (A plain run of the same prompts
was a test of its own: the pressure test checks the same outputs, so it was folded in.)"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors import safe_open

from qworker import LLM, SamplingParams
from qworker.model.batch import Batch, SeqChunk
from qworker.model.families.spec import dims
from qworker.model.runner import ModelRunner
from tests.engine.conftest import FamilyModels
from tests.engine.family_models import FAMILIES, family_config
from tests.engine.family_reference import eager_greedy, eager_last_logits
from tests.engine.hf_reference import assert_greedy_matches

MAX_TOKENS = 16
# the first 4096 of the tokenizer's ids: the embedding and LM head of the full 49152 were most of
# these tiny models' bytes and of the time to build, load and run them (here and in transformers)
VOCAB = 4096


@pytest.fixture(scope="module")
def family_models(tmp_path_factory, model_dir) -> FamilyModels:
    return FamilyModels(tmp_path_factory.mktemp("family-models-small-vocab"), model_dir, vocab_size=VOCAB)


def window_of(model_type: str) -> int:
    return getattr(family_config(model_type), "sliding_window", None) or 0


def prompts_for(model_type: str, seed: int = 0) -> list[list[int]]:
    """A short prompt and three past the family's window (the longest past three windows)."""
    rng = random.Random(f"{model_type}-{seed}")
    w = max(window_of(model_type), 24)
    lengths = [rng.randrange(3, 12), w + rng.randrange(1, 16), 2 * w + rng.randrange(1, 30), 3 * w + rng.randrange(1, 40)]
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def check_against_hf(path, prompts, outs, what):
    for p, o in zip(prompts, outs):
        assert_greedy_matches(o.outputs[0].token_ids, eager_greedy(path, p, MAX_TOKENS), f"{what}, prompt of {len(p)}")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_matches_under_preemption_chunking_and_prefix_hits(family_models, model_type):
    """A KV pool too small for the batch (preemption; recompute only for every other family,
    swap where the scheduler picks it for the rest), 32-token prefill chunks, and requests that
    share a long prompt prefix."""
    path = family_models.get(model_type)
    base = prompts_for(model_type)
    shared = base[-1]
    rng = random.Random(model_type)
    # two more that share the first half (and a block) of `shared`, then go their own way: prefix
    # hits, and enough distinct blocks that the pool cannot hold every running request
    half = len(shared) // 2 + 16
    prompts = base + [shared[:half] + [rng.randrange(3, VOCAB) for _ in range(len(shared) // 2)] for _ in range(2)]
    no_swap = FAMILIES.index(model_type) % 2 == 1
    config = family_config(model_type)
    d = dims(config)
    layers, kv_heads, head_dim = config.num_hidden_layers, d.num_kv_heads, d.head_dim
    block_bytes = 2 * layers * 16 * kv_heads * head_dim * 4
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    blocks = -(-longest // 16) + 2  # room for the longest request alone, and a little more
    llm = LLM(str(path), dtype="float32", kv_cache_memory=blocks * block_bytes, block_size=16, max_num_batched_tokens=32,
              swap_space=0 if no_swap else 64 * block_bytes)
    outs = llm.generate(prompts, greedy())
    stats = llm.stats()
    assert stats["preemptions_swap"] + stats["preemptions_recompute"] > 0, f"{model_type}: no preemption ({stats})"
    assert stats["prefix_cache_hits"] > 0, f"{model_type}: no prefix hits ({stats})"
    check_against_hf(path, prompts, outs, f"{model_type} under pressure")
    # a second identical request is a prefix hit on what is cached now, and must still match
    again = llm.generate([shared], greedy())
    assert llm.stats()["prefix_cache_hits"] > stats["prefix_cache_hits"]
    check_against_hf(path, [shared], again, f"{model_type} repeated")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_logits_close_to_transformers(family_models, model_type):
    """One step that mixes a decode row with two prefill chunks (one continuing a cached prefix):
    every row's logits equal transformers' for the same tokens to 1e-3."""
    path = family_models.get(model_type)
    runner = ModelRunner(str(path), dtype="float32")
    runner.allocate_kv_cache(num_blocks=64, num_cpu_blocks=0, block_size=16)
    a, b, c = prompts_for(model_type, seed=2)[1:]
    # a: prefill all but its last token, then decode it; c: prefill in two chunks
    split = len(c) // 2
    runner.execute(Batch([SeqChunk(a[:-1], 0, list(range(0, 16)), False), SeqChunk(c[:split], 0, list(range(32, 48)), False)]))
    logits = runner.execute(Batch([
        SeqChunk(a[-1:], len(a) - 1, list(range(0, 16)), True),
        SeqChunk(b, 0, list(range(16, 32)), True),
        SeqChunk(c[split:], split, list(range(32, 48)), True),
    ]))
    for row, prompt in zip(logits, (a, b, c)):
        torch.testing.assert_close(row.cpu(), eager_last_logits(path, prompt), atol=1e-3, rtol=1e-3, msg=lambda m: f"{model_type}: {m}")


def test_mistral_window_is_honoured(family_models, tmp_path):
    """The prompts reach past the window: the same weights served without it give other tokens
    (the bug this family's window support fixes: 0 of 6 outputs equal before)."""
    import shutil

    path = family_models.get("mistral")
    no_window = tmp_path / "mistral-no-window"
    shutil.copytree(path, no_window)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = None
    (no_window / "config.json").write_text(json.dumps(cfg))
    prompts = prompts_for("mistral")[1:]
    outs = LLM(str(no_window), dtype="float32", kv_cache_memory=8 << 20).generate(prompts, greedy())
    refs = [eager_greedy(path, p, MAX_TOKENS).token_ids for p in prompts]
    assert any(o.outputs[0].token_ids != r for o, r in zip(outs, refs))


def drafting_prompt(path, rng: random.Random, n: int) -> list[int]:
    """A prompt that already holds the model's first greedy token ``g``, so n-gram lookup (min 1)
    drafts from the first decode step: ``g`` is written at the first position where it does not
    change the model's choice of ``g`` (a few tries on these models)."""
    for _ in range(5):
        prompt = [rng.randrange(3, VOCAB) for _ in range(n)]
        g = int(eager_last_logits(path, prompt).argmax())
        for pos in range(n - 1):
            candidate = prompt[:pos] + [g] + prompt[pos + 1:]
            if int(eager_last_logits(path, candidate).argmax()) == g:
                return candidate
    pytest.fail("no prompt holding its own first greedy token")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_matches_with_forks_and_ngram_speculation(family_models, model_type):
    """n=2 forks (copy-on-write of the shared partial block) and n-gram speculation (drafts
    verified as decode rows, each under its own position's window) keep every family's greedy
    output equal to transformers'."""
    path = family_models.get(model_type)
    rng = random.Random(f"{model_type}-spec")
    w = max(window_of(model_type), 24)
    prompts = [drafting_prompt(path, rng, n) for n in (w + 5, 2 * w + 7)]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=16, speculative_config=spec)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2))
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0, f"{model_type}: nothing drafted"
    for p, o in zip(prompts, outs):
        ref = eager_greedy(path, p, MAX_TOKENS)
        assert len(o.outputs) == 2
        for c in o.outputs:
            assert_greedy_matches(c.token_ids, ref, f"{model_type} fork/spec, prompt of {len(p)}")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "olmoe", "granitemoeshared", "minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe",
                                        "flex_olmo", "phimoe"])
def test_fused_expert_checkpoints_load_as_the_original_layout(family_models, model_type, tmp_path):
    """transformers 5 saves experts stacked (``mlp.experts.gate_up_proj`` / ``down_proj``, Mixtral's
    block renamed ``mlp``) with ``save_original_format=False``: such a checkpoint was refused
    ("missing tensor ...experts.0.gate_proj.weight"); it must serve the same logits, bit for bit."""
    from transformers import AutoModelForCausalLM

    path = family_models.get(model_type)
    fused = tmp_path / "fused"
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(fused, save_original_format=False)
    with safe_open(fused / "model.safetensors", "pt") as f:
        assert any(k.endswith("experts.gate_up_proj") for k in f.keys())
    prompt = prompts_for(model_type, seed=3)[0]
    logits = []
    for p in (path, fused):
        runner = ModelRunner(str(p), dtype="float32")
        runner.allocate_kv_cache(num_blocks=16, num_cpu_blocks=0, block_size=16)
        logits.append(runner.execute(Batch([SeqChunk(prompt, 0, list(range(16)), True)])))
    assert torch.equal(logits[0], logits[1])
