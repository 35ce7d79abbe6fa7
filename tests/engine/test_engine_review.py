"""Adversarial review of the engine after issue 11: one reproduction per defect still found.

Each test states what is expected and what happens; failing ones are marked
``xfail(strict=True)`` so the suite stays green until the fix lands (the fix flips them: remove
the marker then). Tiny random-weight Llama (``tiny_model_dir``), forward failures injected by
wrapping ``runner.execute`` as in test_engine_defects.py.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from qworker import AsyncEngine
from qworker.engine import LLMEngine, SamplingParams
from tests.engine.engine_support import BLOCK_BYTES_TINY, Faults, dirty, engine, greedy, outputs, rand_ids, run















# -- isolation vs max_num_seqs ----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_isolation_livelock_forks_fill_max_num_seqs(tiny_model_dir):
    """Expected: after one transient forward failure in a step with two requests, both finish
    (each suspect runs alone once, then normal batching resumes).

    Happens: with ``max_num_seqs=2``, suspect A (n=2) runs alone and forks, filling both sequence
    slots; it is cleared, then suspect B must run alone, but ``Scheduler._take_queued`` breaks on
    ``len(running) >= max_num_seqs`` before trying B (the ``_idle_victim`` preemption only runs
    when ``_take`` returns None), and the running loop skips A's sequences because only B may
    run. Every later step schedules nothing: ``LLM.generate`` / the AsyncEngine thread spin
    forever."""
    rng = random.Random(1)
    e = engine(tiny_model_dir, max_num_seqs=2)
    faults = Faults(e, lambda batch: len(batch.chunks) == 2)
    e.add_request("a", rand_ids(rng, 10), SamplingParams(n=2, seed=3, max_tokens=4, ignore_eos=True))
    e.add_request("b", rand_ids(rng, 10), greedy(4))
    done = run(e)
    assert faults.raised == 1
    assert set(done) == {"a", "b"} and all(r.error is None for r in done.values())


# -- forks from a parent that finished on its first token --------------------------------------------
def _two_choices(tiny_model_dir, prompt, **kw):
    e = dirty(engine(tiny_model_dir))
    e.add_request("r", prompt, SamplingParams(n=2, seed=11, temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=0, **kw))
    return run(e)["r"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prompt_len", [20, 32])  # 20: IndexError in the scheduler; 32: wrong tokens
def test_fork_of_parent_finished_on_first_token(tiny_model_dir, prompt_len):
    """Expected: with n=2, choice 0 stopping on its first token (a stop token id, or EOS - the
    usual case for a chat model) does not change choice 1: it continues with the tokens it gets
    when choice 0 does not stop.

    Happens: ``LLMEngine._update`` finishes the parent (``_finish`` -> ``scheduler.remove`` ->
    ``kv.free``: its block table is emptied) before it reaches the fork, then
    ``Scheduler.add_fork`` -> ``KVCacheManager.fork`` copies the *empty* block table with
    ``num_computed_tokens = len(prompt)``. The next step ``_needs_cow`` indexes
    ``block_table[num_computed // block_size]`` -> IndexError out of ``LLMEngine.step`` (prompt
    not block-aligned), or for an aligned prompt the child decodes over fresh blocks that never
    held its prompt's KV (wrong tokens)."""
    rng = random.Random(2)
    prompt = rand_ids(rng, prompt_len)
    free_req = _two_choices(tiny_model_dir, prompt)
    free = outputs(free_req)
    first0 = free[0][0]
    assert first0 not in free[1], "pick another seed: choice 1 samples choice 0's first token"
    got = _two_choices(tiny_model_dir, prompt, stop_token_ids=[first0])
    assert outputs(got) == [[first0], free[1]]
    # near-uniform random model: seeded tokens barely depend on the logits; logprobs do
    want_lp = [lp[t].logprob for lp, t in zip(free_req.seqs[1].logprobs, free[1])]
    got_lp = [lp[t].logprob for lp, t in zip(got.seqs[1].logprobs, free[1])]
    assert got_lp == pytest.approx(want_lp, abs=1e-4), "choice 1 decoded over KV that never held its prompt"


# -- AsyncEngine after shutdown ------------------------------------------------------------------------
@pytest.mark.timeout(60)
async def test_generate_after_shutdown_hangs(tiny_model_dir):
    """Expected: ``generate`` on an engine that was shut down raises at once (or yields one
    finished "abort" output): every stream must end.

    Happens: ``AsyncEngine.generate`` queues an "add" command that no engine thread will ever
    take (``shutdown`` joined it and set ``_thread = None``) and awaits its queue forever; the
    same holds for an "add" queued after the "stop" command while shutdown is in progress."""
    eng = AsyncEngine.from_model(str(tiny_model_dir), kv_cache_memory=64 * BLOCK_BYTES_TINY)
    await eng.start()
    await eng.shutdown()

    async def consume():
        return [d async for d in eng.generate("late", [5, 6, 7, 8], greedy(4))]

    try:
        items = await asyncio.wait_for(consume(), timeout=5)
    except asyncio.TimeoutError:
        pytest.fail("generate() after shutdown() hung")
    except Exception:
        return  # raising is an acceptable answer
    assert items and items[-1].finished


# -- the deadline heap keeps finished requests alive ----------------------------------------------------
@pytest.mark.timeout(60)
def test_deadline_heap_retains_finished_requests(tiny_model_dir):
    """Expected: once a request with a deadline has finished (and the caller dropped it), the
    engine holds no reference to it.

    Happens: ``LLMEngine.add_request`` pushes ``(deadline, order, req)`` on ``_deadlines`` and
    ``_expire_deadlines`` pops entries only once their deadline passes; a request that finished
    long before its deadline (the normal case) stays referenced with its detokenizer, token ids
    and logprobs. A worker that sets a generous deadline on every job grows without bound (and
    the heap's O(log n) pushes keep growing too). Drop the entry when the request finishes or
    starts (it can no longer expire once admitted)."""
    e = engine(tiny_model_dir)
    for wave in range(5):
        for i in range(40):
            e.add_request(f"r{wave}-{i}", [5, 6, 7, 8 + i], greedy(2, logprobs=5), deadline=time.time() + 3600)
        done = run(e)
        assert len(done) == 40
    e.add_request("last", [5, 6, 7], greedy(1), deadline=time.time() + 3600)
    e.step()  # a step with a deadline pending compacts the heap
    held = [req.request_id for _, _, req in e._deadlines if req.finished]
    assert len(held) <= 64, f"{len(held)} finished requests still held by the deadline heap"


# -- evicted prefix blocks never reach the CPU tier -----------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.xfail(strict=True, reason="review: evicted cached blocks do not spill to the CPU tier (DESIGN: memory pressure)")
def test_evicted_prefix_blocks_spill_to_cpu_tier(tiny_model_dir):
    """Expected (DESIGN.md, "Memory pressure"): "evicted cached blocks may spill to the CPU tier,
    and a later hit copies them back": with swap space to spare, a prompt whose cached blocks were
    reclaimed by later traffic is still a prefix hit (2 full blocks = 32 cached tokens).

    Happens: ``KVCacheManager`` builds ``BlockPool(num_blocks)`` without ``on_evict``; eviction
    just drops the hash, nothing is copied to the CPU pool and nothing looks there on a miss:
    ``num_cached_tokens`` is 0 (15 blocks evicted, CPU pool idle). Either implement the tier
    (``on_evict`` -> copy to a free CPU block keyed by hash, ``find_cached_prefix`` falls back to
    it and schedules a swap-in copy) or drop the claim from the design."""
    rng = random.Random(5)
    e = engine(tiny_model_dir, kv_cache_memory=8 * BLOCK_BYTES_TINY, swap_space=64 * BLOCK_BYTES_TINY)
    prompt = rand_ids(rng, 40)
    e.add_request("a", prompt, greedy(2))
    run(e)
    for i in range(3):  # unrelated traffic reclaims every cached block
        e.add_request(f"x{i}", rand_ids(rng, 100), greedy(2))
        run(e)
    assert e.stats()["blocks_evicted"] > 0
    again = e.add_request("b", prompt, greedy(2))
    run(e)
    assert again.num_cached_tokens == 32


# -- LLM.generate drops prompts when the priority list is short ------------------------------------------
@pytest.mark.timeout(60)
def test_llm_generate_short_priority_list(tiny_model_dir):
    """Expected: ``LLM.generate(prompts, params, priority)`` with fewer priorities than prompts
    raises ``ValueError`` (as it does for a short ``sampling_params`` list, and as vLLM does).

    Happens: ``LLM.generate`` zips prompts, ids, params and priorities: the prompts past the
    end of ``priority`` are never added and the call returns fewer outputs than prompts, so
    outputs no longer line up with inputs for a caller that ignores the count."""
    from qworker.engine.llm import LLM

    llm = LLM(str(tiny_model_dir), kv_cache_memory=64 * BLOCK_BYTES_TINY)
    prompts = [[5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 10]]
    try:
        outs = llm.generate(prompts, greedy(2), priority=[0])
    except ValueError:
        return
    assert len(outs) == len(prompts), f"{len(prompts)} prompts, {len(outs)} outputs"
