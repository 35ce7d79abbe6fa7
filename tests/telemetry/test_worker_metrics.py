"""Every qworker metric moves in a worker run that causes it: a prefix hit, forced preemptions
(swap and recompute) in a tiny KV pool, evictions, a cancelled job, error codes, a DLQ entry,
consumer lag. A 2-layer random-weight model keeps the engine fast; the broker is real."""

from __future__ import annotations

import asyncio
import random
from collections import Counter, defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qworker.messages import Job, Sampling
from qworker.worker import Worker
from qworker.worker.client import cancel, submit

from .conftest import RawResults

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

BLOCK_BYTES = 8192  # the tiny model: 2 layers x (K, V) x 2 heads x 16 dims x 16 tokens x fp32


async def start_tiny_engine(model_dir, swap_blocks: int):
    from qworker.engine import AsyncEngine

    # 12 blocks (192 tokens) of KV: four 80-token jobs cannot fit, so the scheduler must
    # preempt, swapping while a victim fits in the swap pool, recomputing otherwise.
    eng = AsyncEngine.from_model(
        str(model_dir), device="cpu", kv_cache_memory=12 * BLOCK_BYTES, swap_space=swap_blocks * BLOCK_BYTES, max_num_seqs=8, max_num_batched_tokens=128
    )
    await eng.start()
    return eng


@pytest.fixture
async def tiny_engine(tiny_model_dir):
    eng = await start_tiny_engine(tiny_model_dir, swap_blocks=3)  # room to swap some victims, not all
    yield eng
    await eng.shutdown()


def pressure_jobs(rng: random.Random) -> list[Job]:
    """Four jobs growing to 5 blocks each in the 12-block pool."""
    return [Job(id=f"pressure-{i}", prompt_token_ids=ids(rng, 20), sampling=Sampling(max_tokens=60, temperature=0.0, ignore_eos=True)) for i in range(4)]


def preemption_events(exporter) -> tuple[Counter, Counter, int]:
    """From the generate spans: preemption events by mode, events by name, and the sum of the
    spans' ``qworker.preemptions``."""
    gens = [sp for sp in exporter.get_finished_spans() if sp.name == "generate"]
    events = [e for sp in gens for e in sp.events]
    modes = Counter(e.attributes["qworker.preemption.mode"] for e in events if e.name == "preemption")
    return modes, Counter(e.name for e in events), sum(sp.attributes["qworker.preemptions"] for sp in gens)


def scrape(w: Worker) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(w.metrics.render()[0].decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(n)]


async def test_every_metric_moves(tiny_engine, topics, raw_results: RawResults, tracing, exporter) -> None:
    s = topics.model_copy(update={"admission_reserve_tokens": 0, "max_waiting_jobs": 8, "commit_interval_ms": 100})
    w = Worker(s, tiny_engine, tracing=tracing)
    await w.start()
    peak: dict[tuple[str, tuple], float] = defaultdict(float)

    async def sample() -> None:  # gauges are instantaneous: keep the highest value seen
        while True:
            for k, v in scrape(w).items():
                peak[k] = max(peak[k], v)
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    rng = random.Random(7)
    try:
        # a prefix hit: the same 40-token prompt twice, one after the other
        shared = ids(rng, 40)
        for jid in ("prefix-1", "prefix-2"):
            await submit(s, [Job(id=jid, prompt_token_ids=shared, sampling=Sampling(max_tokens=2, temperature=0.0))])
            await raw_results.wait(lambda: jid in raw_results.completions, 60, jid)
        assert raw_results.completions["prefix-2"][0]["usage"]["cached_tokens"] == 32  # two full blocks; never the last token

        # answers without generation: a DLQ entry, two error codes, a cancel that beat its job
        await cancel(s, "cancelled-early")
        await raw_results.wait(lambda: "cancelled-early" in w.cancels, 20, "the cancel read first")
        await submit(s, [b"\x00 not json", {"id": "bad-schema", "prompt": 5}, Job(id="too-long", prompt_token_ids=ids(rng, 400))])
        await submit(s, [Job(id="cancelled-early", prompt="hi", sampling=Sampling(max_tokens=100, ignore_eos=True))])

        pressure = pressure_jobs(rng)  # memory pressure
        await submit(s, pressure)
        everything = {"prefix-1", "prefix-2", "bad-schema", "too-long", "cancelled-early", *(j.id for j in pressure)}
        await raw_results.wait(lambda: everything <= set(raw_results.completions) and raw_results.dlq, 180, "all answers")

        async def lag_settled() -> None:  # the commit loop publishes lag; wait for the last commit
            while True:
                lags = [v for (n, _), v in scrape(w).items() if n == "qworker:consumer_lag"]
                if lags and not any(lags):
                    return
                await asyncio.sleep(0.1)

        await asyncio.wait_for(lag_settled(), 20)
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        final = scrape(w)
        await w.stop()

    assert raw_results.completions["cancelled-early"][0]["status"] == "cancelled"
    f = final
    # engine counters
    assert f[("qworker:prefix_cache_queries_total", ())] > 0
    assert f[("qworker:prefix_cache_hits_total", ())] >= 32
    assert f[("qworker:prompt_tokens_total", (("source", "cached"),))] >= 32
    assert f[("qworker:prompt_tokens_total", (("source", "computed"),))] > 0
    assert f[("qworker:generation_tokens_total", ())] >= 4 + 4 * 60
    swaps = f[("qworker:num_preemptions_total", (("mode", "swap"),))]
    recomputes = f[("qworker:num_preemptions_total", (("mode", "recompute"),))]
    assert swaps > 0 and recomputes > 0
    assert f[("qworker:blocks_swapped_total", (("direction", "out"),))] > 0
    assert f[("qworker:blocks_swapped_total", (("direction", "in"),))] > 0
    assert f[("qworker:blocks_evicted_total", ())] > 0
    # engine gauges, as sampled while it worked
    assert peak[("qworker:num_requests_running", ())] >= 2
    assert peak[("qworker:kv_cache_usage_perc", ())] > 0.5
    assert peak[("qworker:cpu_swap_usage_perc", ())] > 0
    assert peak[("qworker:num_requests_waiting", ())] + peak[("qworker:num_requests_swapped", ())] > 0
    # request histograms (every job that ran: 2 prefix + 4 pressure)
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert f[(f"qworker:{h}_count", ())] >= 6, h
    assert f[("qworker:inter_token_latency_seconds_count", ())] >= 4 * 59
    # jobs by outcome, and the worker's consumer lag
    jobs = {dict(k[1])["outcome"] + ":" + dict(k[1])["code"]: v for k, v in f.items() if k[0] == "qworker:jobs_total"}
    assert jobs == {"completed:": 6, "cancelled:": 1, "error:invalid_job": 1, "error:prompt_too_long": 1, "dlq:not_json": 1}
    lag_peak = max(v for (n, _), v in peak.items() if n == "qworker:consumer_lag")
    assert lag_peak > 0
    assert f[("qworker:records_total", ())] == 10 and f[("qworker:assigned_partitions", ())] == 4

    # the generate spans replay the engine's own record: every preemption, with its exact mode
    modes, names, span_total = preemption_events(exporter)
    assert modes == {"swap": swaps, "recompute": recomputes}
    assert names["swap_out"] == names["swap_in"] == swaps  # every job finished: each swapped sequence came back
    assert span_total == swaps + recomputes
    dlq_spans = [sp for sp in exporter.get_finished_spans() if sp.name.startswith("process ") and sp.attributes.get("qworker.job.outcome") == "dlq"]
    assert len(dlq_spans) == 1 and dlq_spans[0].attributes["error.type"] == "not_json"


async def test_preemptions_without_swap_pool_are_recomputes(tiny_model_dir, topics, raw_results: RawResults, tracing, exporter) -> None:
    eng = await start_tiny_engine(tiny_model_dir, swap_blocks=0)
    w = Worker(topics.model_copy(update={"admission_reserve_tokens": 0, "max_waiting_jobs": 8}), eng, tracing=tracing)
    try:
        await w.start()
        pressure = pressure_jobs(random.Random(7))
        await submit(w.settings, pressure)
        await raw_results.wait(lambda: {j.id for j in pressure} <= set(raw_results.completions), 180, "pressure jobs")
        await w.stop()
        stats = eng.stats()
    finally:
        await eng.shutdown()
    assert stats["preemptions_swap"] == 0 and stats["preemptions_recompute"] > 0
    modes, names, span_total = preemption_events(exporter)
    assert modes == {"recompute": stats["preemptions_recompute"]}
    assert names["swap_out"] == names["swap_in"] == 0
    assert span_total == stats["preemptions_recompute"]


async def test_gauges_move_while_a_commit_hangs(tiny_engine, topics, raw_results: RawResults, monkeypatch) -> None:
    """The worker's gauges were observed only after each commit round: a commit that waited on a
    broker which went away froze /metrics at its last values. They are observed on their own."""
    from qworker.worker import partitions

    async def commit_that_hangs(*args, **kwargs):
        await asyncio.Event().wait()

    s = topics.model_copy(update={"commit_interval_ms": 100})
    w = Worker(s, tiny_engine)
    await w.start()  # joins the group (its first revoke commits): then every commit hangs
    monkeypatch.setattr(partitions.kc, "commit", commit_that_hangs)
    seen: list[float] = []

    async def sample() -> None:
        while True:
            seen.append(scrape(w).get(("qworker:running_jobs", ()), 0.0))
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample())
    try:
        job = Job(id="long", prompt_token_ids=ids(random.Random(3), 20), sampling=Sampling(max_tokens=300, temperature=0.0, ignore_eos=True))
        await submit(s, [job])
        await raw_results.wait(lambda: "long" in raw_results.completions, 120, "the job")
        await asyncio.sleep(0.5)
        final = scrape(w)
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        await w.stop(1.0)
    assert max(seen) == 1, "running_jobs never showed the running job"
    assert final[("qworker:running_jobs", ())] == 0 and final[("qworker:assigned_partitions", ())] == 4
    # every owned partition has its lag series, the three that never held a record too (helper-72)
    lags = {dict(k[1])["partition"]: v for k, v in final.items() if k[0] == "qworker:consumer_lag"}
    assert lags == {"0": 0, "1": 0, "2": 0, "3": 0}, lags
