"""A step that did not run to its end: a failure (recovered, with blame) or an interrupt
(withdrawn, then re-raised). Either way no request state moved past the schedule, but the
step's KV may be missing or half-written, so nothing it registered may stay hit-able."""

from __future__ import annotations

import logging

from qworker.engine.kv_cache_manager import KVCacheManager
from qworker.engine.outputs import ERR_ENGINE
from qworker.engine.requests import RequestBook
from qworker.engine.scheduler import Scheduler, SchedulerOutput
from qworker.engine.sequence import Request

log = logging.getLogger(__name__)


# a request is failed after this many failed steps in a row that it ran alone in: the first
# may be a one-off (an allocation that failed under load), the second is its own
MAX_LONE_FAILURES = 2


def recover(kv: KVCacheManager, scheduler: Scheduler, book: RequestBook, sched: SchedulerOutput, exc: Exception,
            now: float) -> list[Request]:
    """A step raised (a block copy, the forward or the sampler). No request state moved past
    the schedule, but the step's KV may be missing or half-written. So: its prefix-map entries
    are withdrawn, and every sequence whose KV is now untrusted (those scheduled, swapped in or
    out this step, or holding a withdrawn block) is recomputed from scratch; greedy and seeded
    sampling give the same tokens as without the failure. Blame: the step's requests become
    suspects that run alone, one by one, past the point of failure; a request whose step fails
    ``MAX_LONE_FAILURES`` times in a row while it runs alone fails (``error_code``
    "engine_error"). So a request that breaks every step it is in ends up failing alone, no
    other request gets an error, and a one-off failure costs no request, even a lone one."""
    log.warning("engine step failed: %r", exc, exc_info=exc)
    book.counters["steps_failed"] += 1
    withdraw(kv, scheduler, sched)
    step_reqs = list(dict.fromkeys(s.seq.request for s in sched.scheduled))
    if len(step_reqs) == 1:
        req = step_reqs[0]
        req.lone_failures += 1
        if req.lone_failures >= MAX_LONE_FAILURES:
            if req in scheduler.suspects:
                scheduler.suspects.remove(req)
            if book.requests.pop(req.request_id, None) is None:
                return []
            book.end(req, f"engine step failed: {exc!r}", ERR_ENGINE, now)
            book.counters["requests_failed"] += 1
            return [req]
    for req in step_reqs:
        for seq in req.seqs:
            if not seq.finished:
                seq.suspect_until = max(seq.suspect_until, len(seq.token_ids))
        if req not in scheduler.suspects:
            scheduler.suspects.append(req)
    return []


def withdraw(kv: KVCacheManager, scheduler: Scheduler, sched: SchedulerOutput) -> None:
    """A step that did not run to the end: its prefix-map entries are withdrawn and every
    sequence whose KV is now untrusted (scheduled, swapped in or out this step, or holding a
    withdrawn block) goes back to waiting, to be recomputed from scratch."""
    kv.unregister(sched.registered)
    untrusted = [s.seq for s in sched.scheduled] + [seq for seq, mode in sched.preempted if mode == "swap"] + sched.swapped_in
    withdrawn = {b.block_id for b in sched.registered}
    if withdrawn:
        untrusted += [seq for seq in scheduler.running if any(b.block_id in withdrawn for b in seq.block_table)]
    for seq in dict.fromkeys(untrusted):
        if not seq.finished:
            scheduler.requeue(seq)


def clear_suspect(scheduler: Scheduler) -> None:
    """The isolated suspect is cleared once it has computed, alone, what it had at the failure."""
    req = scheduler.suspects[0]
    if all(s.finished or s.num_computed_tokens >= s.suspect_until for s in req.seqs):
        scheduler.suspects.pop(0)
        req.lone_failures = 0
        for s in req.seqs:
            s.suspect_until = 0
