"""Decode-step speed against the matmul-only ceiling at the same batch size.

The ceiling is the model's linear layers alone (fused qkv, o, gate_up, down per layer, and the
LM head) as plain matmuls on a [batch, hidden] input: no attention, norms, rope or scheduling.
It is timed in the faster of the two weight layouts (``x @ w`` with ``w`` row-major ``[in, out]``,
as the engine stores them, or ``F.linear`` with ``[out, in]``, as checkpoints and HF store them):
on CPU which one wins depends on the batch size, and the ceiling is the best a plain matmul does.

Decode steps and ceiling passes are timed alternately, round after round, and each side reports
its median: on a shared, noisy machine the two then see the same conditions.
"""

from __future__ import annotations

import random
import statistics
import time

import torch
import torch.nn.functional as F

from qworker.engine import LLMEngine, SamplingParams


def decode_vs_ceiling(engine: LLMEngine, batch: int, context: int = 160, rounds: int = 9) -> dict:
    """Median decode-step tokens/s (scheduling, attention, sampling included; every sequence with
    about ``context`` tokens of KV) and the median matmul-only tokens/s at this batch size."""
    warmup = 2
    # early prefill chunks already decode while later ones prefill: leave room, abort at the end
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    rng = random.Random(batch)
    ids = [f"ceiling-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(100, 30000) for _ in range(context)], params)
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        engine.step()  # prefills
    for _ in range(warmup):
        engine.step()
    passes = _matmul_passes(engine, batch)
    step_times: list[float] = []
    pass_times: list[list[float]] = [[] for _ in passes]
    device = engine.runner.device
    with torch.inference_mode():
        for once in passes:
            once()  # warm-up
        for _ in range(rounds):
            assert len(engine.scheduler.running) == batch, f"the probe needs every sequence decoding ({len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} waiting)"
            step_times.append(_timed(engine.step, device))
            for once, times in zip(passes, pass_times):
                times.append(_timed(once, device))
    assert engine.stats()["preemptions_swap"] + engine.stats()["preemptions_recompute"] == 0, "the probe's pool is too small"
    for rid in ids:
        engine.abort(rid)
    decode = batch / statistics.median(step_times)
    ceiling = batch / min(statistics.median(t) for t in pass_times)
    return {"batch": batch, "decode_tokens_per_s": decode, "matmul_ceiling_tokens_per_s": ceiling, "fraction": decode / ceiling, "rounds": rounds}


def _matmul_passes(engine: LLMEngine, batch: int) -> list:
    """One closure per weight layout, each running every linear layer of the model once."""
    m = engine.runner.model
    x = torch.randn(batch, m.config.hidden_size, device=m.device, dtype=m.dtype)
    # real values, allocated once: uninitialised memory can hold denormals that skew timings
    x_attn = torch.randn(batch, m.q_size, device=m.device, dtype=m.dtype)
    x_mlp = torch.randn(batch, m.layers[0].down.shape[0], device=m.device, dtype=m.dtype)
    in_out = [pair for layer in m.layers for pair in ((x, layer.qkv), (x_attn, layer.o), (x, layer.gate_up), (x_mlp, layer.down))]
    in_out.append((x, m.lm_head))
    out_in = [(inp, w.t().contiguous()) for inp, w in in_out]

    def right_operand():
        for inp, w in in_out:
            inp @ w

    def linear():
        for inp, w in out_in:
            F.linear(inp, w)

    return [right_operand, linear]


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
