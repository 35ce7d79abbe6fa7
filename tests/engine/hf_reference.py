"""Greedy reference outputs from HF transformers, and a tie-aware comparison."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

TIE_GAP = 1e-3  # logprob gap under which two tokens count as tied (float noise)


@dataclass
class Reference:
    token_ids: list[int]
    top2_gaps: list[float]  # per position, logprob(top1) - logprob(top2) under HF


@lru_cache(maxsize=2)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # Like the engine's ignore_eos: EOS is an ordinary token that neither stops generation nor is
    # suppressed (min_new_tokens would mask it and pick the runner-up instead).
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    model = hf_model(str(model_dir))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,  # raw logits: the tie check must see what the model saw
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    gaps = []
    for scores in out.logits:
        top = torch.log_softmax(scores[0].float(), -1).topk(2).values
        gaps.append((top[0] - top[1]).item())
    return Reference(tokens, gaps)


def assert_greedy_matches(engine_ids: list[int], ref: Reference, what: str = "", tie_gap: float = TIE_GAP) -> None:
    """Token-for-token equality, except that at the first position where HF's two best tokens are
    tied within float noise the engine may pick the other one (the sequences then diverge, so the
    comparison stops there). Never more than that."""
    assert len(engine_ids) == len(ref.token_ids), f"{what}: length {len(engine_ids)} != {len(ref.token_ids)}"
    for i, (a, b) in enumerate(zip(engine_ids, ref.token_ids)):
        if a != b:
            assert ref.top2_gaps[i] < tie_gap, f"{what}: token {i} differs ({a} vs HF {b}) with HF top-2 gap {ref.top2_gaps[i]:.4f}"
            return
