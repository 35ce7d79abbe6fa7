"""Decode-step speed against the matmul-only ceiling at the same batch size.

The ceiling is the model's linear layers alone (fused qkv, o, gate_up, down per layer, and the
LM head) as GEMMs on a [batch, hidden] input: no attention, norms, rope or scheduling. It is the
fastest GEMM path measured on this machine at this batch size, of: ``x @ w`` with ``w`` row-major
``[in, out]``; ``F.linear`` with ``[out, in]`` (as checkpoints and HF store them); and, where the
torch build has it, oneDNN with each weight packed once (``torch.ops.mkldnn._linear_pointwise``,
what the engine runs on CPU when it wins). Whichever path the engine itself uses, the fraction is
then a fraction of what this machine's GEMMs can do, not of one library's sgemm.

Decode steps and ceiling passes are timed alternately, round after round, and each side reports
its median: on a shared, noisy machine the two then see the same conditions.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from bench.drive import fill_decoding
from qworker.engine import LLMEngine


def decode_vs_ceiling(engine: LLMEngine, batch: int, context: int = 160, rounds: int = 9) -> dict:
    """Median decode-step tokens/s (scheduling, attention, sampling included; every sequence with
    about ``context`` tokens of KV) and the median matmul-only tokens/s at this batch size."""
    warmup = 2
    ids = fill_decoding(engine, batch, context, "ceiling")
    for _ in range(warmup):
        engine.step()
    passes = _matmul_passes(engine, batch)
    step_times: list[float] = []
    pass_times: list[list[float]] = [[] for _ in passes]
    device = engine.runner.device
    with torch.inference_mode():
        for _, once in passes:
            once()  # warm-up
        for _ in range(rounds):
            assert len(engine.scheduler.running) == batch, f"the probe needs every sequence decoding ({len(engine.scheduler.running)} running, {len(engine.scheduler.waiting)} waiting)"
            step_times.append(_timed(engine.step, device))
            for (_, once), times in zip(passes, pass_times):
                times.append(_timed(once, device))
    assert engine.stats()["preemptions_swap"] + engine.stats()["preemptions_recompute"] == 0, "the probe's pool is too small"
    for rid in ids:
        engine.abort(rid)
    decode = batch / statistics.median(step_times)
    medians = {name: statistics.median(t) for (name, _), t in zip(passes, pass_times)}
    fastest = min(medians, key=medians.get)
    ceiling = batch / medians[fastest]
    return {"batch": batch, "decode_tokens_per_s": decode, "matmul_ceiling_tokens_per_s": ceiling, "fraction": decode / ceiling, "rounds": rounds,
            "ceiling_path": fastest, "gemm_pass_ms": {name: t * 1e3 for name, t in medians.items()},
            "decode_step_ms": statistics.median(step_times) * 1e3, "linear_backend": getattr(engine.runner.model, "linear_backend", "")}


def _matmul_passes(engine: LLMEngine, batch: int) -> list:
    """(name, closure) per GEMM path, each running every linear layer of the model once."""
    from qworker.model.linear import onednn_supported

    m = engine.runner.model
    x = torch.randn(batch, m.config.hidden_size, device=m.device, dtype=m.dtype)
    # real values, allocated once: uninitialised memory can hold denormals that skew timings
    x_attn = torch.randn(batch, m.q_size, device=m.device, dtype=m.dtype)
    x_mlp = torch.randn(batch, m.layers[0].down.in_features, device=m.device, dtype=m.dtype)
    linears = [pair for layer in m.layers for pair in ((x, layer.qkv), (x_attn, layer.o), (x, layer.gate_up), (x_mlp, layer.down))]
    linears.append((x, m.lm_head))
    out_in = [(inp, lin.dense_out_in().contiguous()) for inp, lin in linears]
    in_out = [(inp, w.t().contiguous()) for inp, w in out_in]

    def right_operand():
        for inp, w in in_out:
            inp @ w

    def linear():
        for inp, w in out_in:
            F.linear(inp, w)

    passes = [("x @ w", right_operand), ("F.linear", linear)]
    if m.device.type == "cpu" and onednn_supported(m.dtype)[0]:
        packed = [(inp, torch.ops.mkldnn._reorder_linear_weight(w, None)) for inp, w in out_in]

        def onednn():
            for inp, w in packed:
                torch.ops.mkldnn._linear_pointwise(inp, w, None, "none", [], "")

        passes.append(("oneDNN packed", onednn))
    return passes


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
