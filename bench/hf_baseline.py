"""HF transformers baselines on the same workload: one request at a time, and static padded batches."""

from __future__ import annotations

import time

import torch

from bench.workloads import Item


def load_hf(model_dir: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


@torch.inference_mode()
def run_batch(model, items: list[Item], pad_id: int, device: str = "cpu") -> float:
    """One static batch, left-padded; runs until the longest output is done. Returns seconds."""
    width = max(len(it.prompt_ids) for it in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, it in enumerate(items):
        ids[i, width - len(it.prompt_ids) :] = torch.tensor(it.prompt_ids)
        mask[i, width - len(it.prompt_ids) :] = 1
    new = max(it.max_tokens for it in items)
    n = items[0].n
    if any(it.n != n for it in items):
        raise ValueError("a static batch needs one n for all its requests")
    # n > 1: HF samples n sequences per prompt (greedy cannot return n distinct ones)
    sampling = {"do_sample": True, "num_return_sequences": n, "temperature": 0.8, "top_k": 0, "top_p": 1.0} if n > 1 else {"do_sample": False}
    start = time.perf_counter()
    model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id, **sampling)
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def batches_of(items: list[Item], size: int) -> list[list[Item]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def batches_within_budget(items: list[Item], budget_tokens: int) -> list[list[Item]]:
    """Static batches as large as fit when each request reserves prompt + max_tokens contiguously
    (the PagedAttention paper's baseline)."""
    out: list[list[Item]] = []
    cur: list[Item] = []
    used = 0
    for it in items:
        need = len(it.prompt_ids) + it.max_tokens
        if cur and used + need > budget_tokens:
            out.append(cur)
            cur, used = [], 0
        cur.append(it)
        used += need
    if cur:
        out.append(cur)
    return out


def useful_rate(model, batches: list[list[Item]], pad_id: int, device: str = "cpu") -> dict:
    """Useful output tokens/s over the given batches (each request's own max_tokens x n count)."""
    seconds = 0.0
    tokens = 0
    reqs = 0
    for b in batches:
        seconds += run_batch(model, b, pad_id, device)
        tokens += sum(it.max_tokens * it.n for it in b)
        reqs += len(b)
    return {"tokens_per_s": tokens / seconds, "requests_per_s": reqs / seconds, "seconds": seconds, "requests": reqs, "batches": len(batches)}
