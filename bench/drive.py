"""Drives an ``LLMEngine`` through a workload with an arrival schedule, in one thread.

``drive()`` adds each request when its arrival time has come (offsets in seconds from the start;
all zero means everything arrives at once), steps the engine while anything is unfinished and
sleeps until the next arrival otherwise. Latencies are measured from the *scheduled* arrival
time, so a request due while a step is running is charged the wait for that step, as a real
queue would charge it. It records per-request TTFT / TPOT / end-to-end latency, the engine's
counters over the run, and a timeline of KV blocks and queue sizes after every step.
"""

from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass, field

import torch

from bench.report import summary
from bench.workloads import Item
from qworker.engine import EngineConfig, LLMEngine, SamplingParams

MiB = 1 << 20

COUNTERS = (
    "prompt_tokens_computed",
    "prompt_tokens_cached",
    "generation_tokens",
    "steps",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "preemptions_swap",
    "preemptions_recompute",
    "blocks_swapped_out",
    "blocks_swapped_in",
    "cow_copies",
    "requests_finished",
)


@dataclass
class Job:
    item: Item
    arrival: float = 0.0  # seconds after the start
    params: SamplingParams | None = None
    request_id: str = ""


@dataclass
class Run:
    seconds: float
    requests: list[dict]
    counters: dict
    timeline: list[dict] = field(default_factory=list)
    peak: dict = field(default_factory=dict)

    def useful_tokens(self, group: str | None = None) -> int:
        return sum(r["output_tokens"] for r in self.requests if group is None or r["group"] == group)

    def summary(self, group: str | None = None) -> dict:
        rs = [r for r in self.requests if group is None or r["group"] == group]
        span = (max(r["finished"] for r in rs) - min(r["arrival"] for r in rs)) if rs else 0.0
        toks = sum(r["output_tokens"] for r in rs)
        return {
            "requests": len(rs),
            "output_tokens": toks,
            "seconds": span,
            "tokens_per_s": toks / span if span else 0.0,
            "requests_per_s": len(rs) / span if span else 0.0,
            "ttft_s": summary(r["ttft"] for r in rs),
            "tpot_s": summary(r["tpot"] for r in rs),
            "e2e_s": summary(r["e2e"] for r in rs),
        }


def fill_decoding(engine: LLMEngine, batch: int, context: int, tag: str) -> list[str]:
    """``batch`` requests of ``context`` random prompt tokens (seeded by ``batch``), stepped until
    each has its first token, so that every later step decodes all of them (they never finish:
    EOS ignored, max_tokens 10,000). Returns their ids (``{tag}-{batch}-{i}``) for the caller to abort."""
    rng = random.Random(batch)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(100, 30000) for _ in range(context)], params)
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        engine.step()
    return ids


def new_engine(model: str, device: str = "cpu", dtype: str = "auto", kv_memory_mib: float = 256, **config) -> LLMEngine:
    gc.collect()
    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, kv_cache_memory=int(kv_memory_mib * MiB), **config))


def greedy(max_tokens: int, n: int = 1, temperature: float | None = None) -> SamplingParams:
    """EOS ignored; greedy unless n > 1 (n greedy choices would all be equal: those sample at 0.8
    from the engine's seeded generator)."""
    if temperature is None:
        temperature = 0.8 if n > 1 else 0.0
    return SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, temperature=temperature)


def jobs_for(items: list[Item], arrivals: list[float] | None = None, prefix: str = "req", temperature: float | None = None) -> list[Job]:
    arrivals = arrivals or [0.0] * len(items)
    return [Job(it, a, greedy(it.max_tokens, it.n, temperature), f"{prefix}-{i}") for i, (it, a) in enumerate(zip(items, arrivals))]


def steady(num: int, rate: float, start: float = 0.0) -> list[float]:
    """Evenly spaced arrivals, ``rate`` per second."""
    return [start + i / rate for i in range(num)]


def poisson(num: int, rate: float, seed: int = 0, start: float = 0.0) -> list[float]:
    rng = random.Random(seed)
    t, out = start, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def warm_up(engine: LLMEngine) -> None:
    """A couple of tiny requests so one-off costs (first matmuls, allocator) stay out of the run."""
    rng = random.Random(12345)
    for i in range(2):
        engine.add_request(f"warm-{i}", [rng.randrange(1000, 20000) for _ in range(24)], greedy(4))
    while engine.has_unfinished():
        engine.step()


def drive(engine: LLMEngine, jobs: list[Job], timeline: bool = True) -> Run:
    jobs = sorted(jobs, key=lambda j: j.arrival)
    before = engine.stats()
    forward = _count_forward_tokens(engine)
    sched: dict[str, tuple[Job, float]] = {}
    reqs = {}
    tl: list[dict] = []
    peak = {"kv_blocks_used": 0, "num_running": 0, "cpu_swap_blocks_used": 0}
    _sync(engine)
    t0 = time.time()
    i = 0
    while i < len(jobs) or engine.has_unfinished():
        now = time.time() - t0
        while i < len(jobs) and jobs[i].arrival <= now:
            j = jobs[i]
            rid = j.request_id or f"req-{i}"
            reqs[rid] = engine.add_request(rid, j.item.prompt_ids, j.params or greedy(j.item.max_tokens, j.item.n))
            sched[rid] = (j, t0 + j.arrival)
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, jobs[i].arrival - (time.time() - t0)))
            continue
        engine.step()
        if timeline:
            s = engine.stats()
            point = {
                "t": time.time() - t0,
                "kv_blocks_used": s["kv_blocks_used"],
                "num_running": s["num_running"],
                "num_waiting": s["num_waiting"],
                "num_swapped": s["num_swapped"],
                "cpu_swap_blocks_used": s["cpu_swap_blocks_used"],
            }
            tl.append(point)
            for k in peak:
                peak[k] = max(peak[k], point[k])
    _sync(engine)
    end = time.time()
    after = engine.stats()
    records = []
    for rid, req in reqs.items():
        job, arrival = sched[rid]
        m = req.metrics
        out_tokens = sum(s.num_output_tokens for s in req.seqs)
        per_seq = max(s.num_output_tokens for s in req.seqs)
        records.append(
            {
                "id": rid,
                "group": job.item.group,
                "prompt_tokens": len(job.item.prompt_ids),
                "output_tokens": out_tokens,
                "arrival": arrival - t0,
                "finished": m.finished_time - t0,
                "ttft": m.first_token_time - arrival,
                "e2e": m.finished_time - arrival,
                "tpot": (m.finished_time - m.first_token_time) / (per_seq - 1) if per_seq > 1 else None,
                "queue": m.first_scheduled_time - arrival,
                "cached_tokens": req.num_cached_tokens,
                "preemptions": m.num_preemptions,
            }
        )
    counters = {k: after[k] - before[k] for k in COUNTERS}
    counters["forward_tokens"] = forward["tokens"]  # every token through the model, recomputation included
    counters["kv_blocks_total"] = after["kv_blocks_total"]
    counters["cpu_swap_blocks_total"] = after["cpu_swap_blocks_total"]
    return Run(seconds=end - t0, requests=records, counters=counters, timeline=tl, peak=peak)


def _count_forward_tokens(engine: LLMEngine) -> dict:
    """Counts the tokens each step sends through the model (prefill, recomputation after a
    preemption and decode alike) by wrapping the scheduler's ``schedule`` on this instance."""
    sched = engine.scheduler
    counter = {"tokens": 0}
    inner = sched.__dict__.get("_bench_inner") or sched.schedule
    sched._bench_inner = inner

    def schedule():
        out = inner()
        counter["tokens"] += out.num_batched_tokens
        return out

    sched.schedule = schedule
    return counter


def _sync(engine: LLMEngine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
