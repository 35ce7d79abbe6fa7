"""transformers' own model (fp32, eager attention) as the reference for a family test model:
greedy continuations with their top-2 gaps (see :mod:`tests.engine.hf_reference`) and logits."""

from __future__ import annotations

from functools import lru_cache

import torch

from tests.engine.hf_reference import Reference


@lru_cache(maxsize=4)
def eager_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS is an ordinary token
    return model


def eager_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> Reference:
    return _eager_greedy(str(model_dir), tuple(prompt_ids), max_new_tokens)


@lru_cache(maxsize=256)  # tests share prompts: each continuation is computed once
def _eager_greedy(model_dir: str, prompt_ids: tuple[int, ...], max_new_tokens: int) -> Reference:
    prompt_ids = list(prompt_ids)
    model = eager_model(model_dir)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    gaps = []
    for scores in out.logits:
        top = torch.log_softmax(scores[0].float(), -1).topk(2).values
        gaps.append((top[0] - top[1]).item())
    return Reference(out.sequences[0, len(prompt_ids):].tolist(), gaps)


def eager_last_logits(model_dir, prompt_ids: list[int]) -> torch.Tensor:
    model = eager_model(str(model_dir))
    with torch.inference_mode():
        return model(torch.tensor([prompt_ids])).logits[0, -1].float()
