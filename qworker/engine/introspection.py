"""What the engine reports about itself: admission's capacity and the stats gauges read."""

from __future__ import annotations

from dataclasses import dataclass

from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.scheduler import Scheduler
from qworker.engine.spec_decode.speculator import Speculator
from qworker.engine.structured.outputs import StructuredOutputs


@dataclass(slots=True)
class Capacity:
    """What admission control needs: KV token slots not spoken for, and queue sizes."""

    free_tokens: int
    total_tokens: int
    block_size: int
    num_running: int
    num_waiting: int


def engine_capacity(kv: KVCacheManager, scheduler: Scheduler) -> Capacity:
    pool = kv.pool
    bs = kv.block_size
    pending = sum(len(s.token_ids) for s in scheduler.waiting) + sum(
        len(s.token_ids) - s.num_computed_tokens for s in scheduler.running
    )
    free = pool.num_free * bs - pending
    return Capacity(max(free, 0), pool.num_blocks * bs, bs, len(scheduler.running), len(scheduler.waiting) + len(scheduler.swapped))


def engine_stats(kv: KVCacheManager, scheduler: Scheduler, counters: dict[str, int], structured: StructuredOutputs,
                 speculator: Speculator) -> dict:
    pool = kv.pool
    used_tokens = sum(s.num_computed_tokens for s in scheduler.running)
    used_slots = sum(len(s.block_table) for s in scheduler.running) * kv.block_size
    return {
        "kv_blocks_total": pool.num_blocks,
        "kv_blocks_used": pool.num_used,
        "kv_blocks_cached_free": pool.num_cached_free,
        "kv_blocks_free": pool.num_free,
        "kv_usage": pool.num_used / pool.num_blocks,
        "kv_slot_utilization": used_tokens / used_slots if used_slots else 1.0,
        "cpu_swap_blocks_total": kv.cpu_pool.num_blocks,
        "cpu_swap_blocks_used": kv.cpu_pool.num_blocks - kv.cpu_pool.num_free,
        "prefix_cache_queries": kv.prefix_queries,
        "prefix_cache_hits": kv.prefix_hits,
        "preemptions_swap": scheduler.num_preemptions["swap"],
        "preemptions_recompute": scheduler.num_preemptions["recompute"],
        "blocks_swapped_out": kv.blocks_swapped_out,
        "blocks_swapped_in": kv.blocks_swapped_in,
        "blocks_evicted": pool.num_evicted,
        "cow_copies": kv.cow_copies,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "num_swapped": len(scheduler.swapped),
        "num_compiling": len(structured.compiling),
        **counters,
        **speculator.as_dict(),
        **structured.grammars.stats(),
        **structured.bitmask.stats(),
    }
