"""Shared pieces of the structured-output tests: the real SmolLM2 tokenizer and model, loaded
once per process, and a tiny batched greedy decode loop over HF transformers that applies the
structured bitmask to each step's logits (phase 1 runs without the engine)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch

from qworker.engine.structured import StructuredBitmask, StructuredState, build_tokenizer_info
from tests.conftest import real_model_dir


@functools.cache
def model_path() -> str:
    return str(real_model_dir())


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path())


@functools.cache
def model_config():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path())


@functools.cache
def tokenizer_info():
    return build_tokenizer_info(tokenizer(), model_config().vocab_size, [tokenizer().eos_token_id])


@functools.cache
def model():
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path(), dtype=torch.float32)
    m.eval()
    return m


@pytest.fixture
def one_thread():
    """One intra-op thread for a test: on the shared 2-core box more threads spin against each
    other and small ops over the vocabulary get ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def chat(text: str) -> str:
    return tokenizer().apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


@dataclass
class Gen:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"


def generate(prompts: list[str], states: list[StructuredState | None], max_new_tokens: int, bitmask: StructuredBitmask | None = None) -> list[Gen]:
    """Greedy, batched (left padding, HF KV cache); a row with a state is masked each step and
    advances its state by the token it takes; EOS (or a terminated grammar) ends a row. One
    intra-op thread: on the shared 2-core box more threads spin against each other (10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return _generate(prompts, states, max_new_tokens, bitmask)
    finally:
        torch.set_num_threads(threads)


def _generate(prompts: list[str], states: list[StructuredState | None], max_new_tokens: int, bitmask: StructuredBitmask | None) -> list[Gen]:
    tok, m = tokenizer(), model()
    eos = tok.eos_token_id
    bitmask = bitmask or StructuredBitmask(model_config().vocab_size)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    attn = enc.attention_mask
    cur, past = enc.input_ids, None
    outs: list[list[int]] = [[] for _ in prompts]
    finish: list[str | None] = [None] * len(prompts)
    for _ in range(max_new_tokens):
        out = m(input_ids=cur, attention_mask=attn, past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1, :].float()
        bitmask.apply(logits, [(i, s) for i, s in enumerate(states) if s is not None and finish[i] is None])
        nxt = logits.argmax(dim=-1).tolist()
        for i, t in enumerate(nxt):
            if finish[i] is not None:
                continue
            s = states[i]
            if s is not None:
                assert s.accept(t), f"row {i}: a masked greedy token {t} was refused"
            if t == eos or (s is not None and s.is_terminated()):
                finish[i] = "stop"
            else:
                outs[i].append(t)
        if all(f is not None for f in finish):
            break
        cur = torch.tensor(nxt).unsqueeze(1)
        attn = torch.cat([attn, torch.ones((len(prompts), 1), dtype=attn.dtype)], dim=1)
    return [Gen(ids, tok.decode(ids), f or "length") for ids, f in zip(outs, finish)]
