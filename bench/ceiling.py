"""Decode-step speed against the matmul-only ceiling at the same batch size.

The ceiling is the model's linear layers alone (fused qkv, o, gate_up, down per layer, and the
LM head) as plain matmuls on a [batch, hidden] input: no attention, norms, rope or scheduling.
"""

from __future__ import annotations

import random
import time

import torch
import torch.nn.functional as F

from qworker.engine import LLMEngine, SamplingParams


def matmul_ceiling(engine: LLMEngine, batch: int, iters: int = 5) -> float:
    """Tokens/s of the linear layers alone at this batch size, in the faster of the two weight
    layouts (``x @ w`` with ``w`` row-major ``[in, out]``, as the engine stores them, or
    ``F.linear`` with ``[out, in]``, as checkpoints and HF store them): on CPU which one wins depends
    on the batch size, and the ceiling is the best a plain matmul can do."""
    m = engine.runner.model
    x = torch.randn(batch, m.config.hidden_size, device=m.device, dtype=m.dtype)
    # real values, allocated once: uninitialised memory can hold denormals that skew timings
    x_attn = torch.randn(batch, m.q_size, device=m.device, dtype=m.dtype)
    x_mlp = torch.randn(batch, m.layers[0].down.shape[0], device=m.device, dtype=m.dtype)
    weights = [pair for layer in m.layers for pair in ((x, layer.qkv), (x_attn, layer.o), (x, layer.gate_up), (x_mlp, layer.down))]
    weights.append((x, m.lm_head))

    def right_operand():
        for inp, w in weights:
            inp @ w

    rates = [_rate(right_operand, batch, iters, m.device)]
    out_in = [(inp, w.t().contiguous()) for inp, w in weights]

    def linear():
        for inp, w in out_in:
            F.linear(inp, w)

    rates.append(_rate(linear, batch, iters, m.device))
    return max(rates)


def _rate(once, batch: int, iters: int, device: torch.device) -> float:
    with torch.inference_mode():
        once()
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            once()
        _sync(device)
    return batch * iters / (time.perf_counter() - start)


def decode_step_rate(engine: LLMEngine, batch: int, context: int = 160, iters: int = 5) -> float:
    """Tokens/s of full engine decode steps (scheduling, attention, sampling included) at this
    batch size, every sequence with about ``context`` tokens of KV."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=iters + 3, ignore_eos=True)
    ids = [f"ceiling-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(100, 30000) for _ in range(context)], params)
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        engine.step()  # prefills
    engine.step()
    _sync(engine.runner.device)
    start = time.perf_counter()
    tokens = 0
    for _ in range(iters):
        sched_batch = len(engine.scheduler.running)
        engine.step()
        tokens += sched_batch
    _sync(engine.runner.device)
    rate = tokens / (time.perf_counter() - start)
    assert engine.stats()["preemptions_swap"] + engine.stats()["preemptions_recompute"] == 0, "the probe's pool is too small"
    for rid in ids:
        engine.abort(rid)
    return rate


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
