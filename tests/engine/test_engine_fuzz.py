"""Fuzzed workloads with a shadow of every KV slot, checked after each step.

Random requests (forks, priorities, aborts, deadlines, shared prefixes) run over tiny pools that
force swap and recompute, while forward failures are injected now and then (before the forward
writes anything, or after it wrote everything) and one "poison" request breaks every step it is
in. A shadow mirrors the KV pools: for each slot, which prefix (token ids up to and including its
position) it holds, and the K/V values the engine last wrote there. After every step:

- the real pools equal the shadow's values: nothing was written but the step's own slots;
- every computed position of every running (or swapped) sequence holds its own prefix;
- a prefix computed twice (recompute, prefix hits, forks) gives the same K/V both times.

At the end every request finished, the poison one with "engine_error", every other one (bar those
aborted, expired, or failed alone by an injected fault) with the tokens of a batch without
failures, and every block is free.

The same runs with speculative decoding (n-gram drafts, random k): rejected drafts write slots
past ``num_computed_tokens`` that the checks above must never see as a sequence's own; after
every step each hashed block in a block table holds accepted tokens only (its hash is that of the
sequence's tokens), and every block's ref count equals the block-table entries naming it. The
reference batch runs without speculation: greedy and seeded outputs must not change.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from qworker.engine import EngineConfig, LLMEngine, SamplingParams
from qworker.engine.sequence import SeqStatus

BLOCK = 4
BLOCK_BYTES_TINY = 2 * 2 * BLOCK * 2 * 16 * 4  # layers * (k,v) * block * kv_heads * head_dim * fp32
POISON = 50  # outside the range of the random prompt tokens


class Injected(RuntimeError):
    pass


class Shadow:
    def __init__(self, e: LLMEngine, rng: random.Random, fault_rate: float):
        self.e, self.rng, self.fault_rate = e, rng, fault_rate
        kv = e.runner.kv
        self.kv = kv
        self.dev_prefix: dict[tuple[int, int], tuple[int, ...]] = {}
        self.cpu_prefix: dict[tuple[int, int], tuple[int, ...]] = {}
        self.dev = [(k.clone(), v.clone()) for k, v in kv.layers]
        self.cpu = [(k.clone(), v.clone()) for k, v in kv.cpu_layers]
        self.ref: dict[tuple[int, ...], torch.Tensor] = {}  # prefix -> K/V of its last position
        self.faults = 0
        self.real_apply, self.real_execute = kv.apply, e.runner.execute
        kv.apply = self.apply
        e.runner.execute = self.execute

    def apply(self, swap_out, swap_in, copy):
        self.real_apply(swap_out, swap_in, copy)
        for pairs, src_prefix, dst_prefix, src, dst in (
            (swap_out, self.dev_prefix, self.cpu_prefix, self.dev, self.cpu),
            (swap_in, self.cpu_prefix, self.dev_prefix, self.cpu, self.dev),
            (copy, self.dev_prefix, self.dev_prefix, self.dev, self.dev),
        ):
            for a, b in pairs:
                for off in range(BLOCK):
                    dst_prefix[(b, off)] = src_prefix.get((a, off))
                for (sk, sv), (dk, dv) in zip(src, dst):
                    dk[b], dv[b] = sk[a], sv[a]

    def execute(self, batch):
        poisoned = any(POISON in c.token_ids for c in batch.chunks)
        # steps that move blocks are the interesting ones to fail
        rate = self.fault_rate * (10 if batch.swap_out or batch.swap_in or batch.copy else 1)
        mode = self.rng.random() < rate and self.rng.choice(["before", "after"])
        if mode == "before" and not poisoned:
            self.faults += 1
            raise Injected("before the forward")
        logits = self.real_execute(batch)
        # a chunk may read a prefix another chunk of the same batch writes (same-step sharing):
        # mirror the writers first
        pending = list(batch.chunks)
        written = {self._slot(c.block_ids, c.start_pos + i) for c in pending for i in range(len(c.token_ids))}
        while pending:
            c = next(c for c in pending if not c.start_pos or self._slot(c.block_ids, c.start_pos - 1) not in written)
            pending.remove(c)
            prev = self.dev_prefix.get(self._slot(c.block_ids, c.start_pos - 1), ()) if c.start_pos else ()
            for i, tok in enumerate(c.token_ids):
                slot = self._slot(c.block_ids, c.start_pos + i)
                written.discard(slot)
                prev = prev + (tok,)
                self.dev_prefix[slot] = prev
                got = self._values(self.kv.layers, slot)
                for (dk, dv), (k, v) in zip(self.dev, self.kv.layers):
                    dk[slot], dv[slot] = k[slot], v[slot]
                want = self.ref.setdefault(prev, got)
                assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), f"prefix of {len(prev)} tokens computed twice differently"
        if poisoned:
            raise Injected("poison")
        if mode == "after":
            self.faults += 1
            raise Injected("after the forward")
        return logits

    @staticmethod
    def _slot(block_ids, pos):
        return block_ids[pos // BLOCK], pos % BLOCK

    @staticmethod
    def _values(layers, slot):
        return torch.stack([t[slot] for k, v in layers for t in (k, v)])

    def check(self):
        for (k, v), (sk, sv) in zip(self.kv.layers, self.dev):
            assert torch.equal(k, sk) and torch.equal(v, sv), "a KV slot changed outside the step's own writes"
        for seq in self.e.scheduler.running:
            for p in range(seq.num_computed_tokens):
                slot = (seq.block_table[p // BLOCK].block_id, p % BLOCK)
                got = self.dev_prefix.get(slot)
                assert got == tuple(seq.token_ids[: p + 1]), (
                    f"seq {seq.seq_id} ({seq.request.request_id}) position {p}: slot {slot} holds "
                    f"{None if got is None else (len(got), got[-3:])}, want {seq.token_ids[max(p - 2, 0) : p + 1]}")
        refs: dict[int, int] = {}
        for seq in self.e.scheduler.running:
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens
            for i, block in enumerate(seq.block_table):
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
                if block.block_hash is not None:
                    # hashed only once full of accepted tokens, with the hash of those tokens
                    assert (i + 1) * BLOCK <= len(seq.token_ids), f"seq {seq.seq_id}: block {i} hashed before it was full of accepted tokens"
                    assert block.block_hash == seq.full_block_hashes(BLOCK, i + 1)[i], f"seq {seq.seq_id}: block {i} hash is not its tokens'"
        for block in self.e.kv.pool.blocks:
            assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id}: ref_count {block.ref_count}, held {refs.get(block.block_id, 0)} times"
        for seq in self.e.scheduler.swapped:
            for p in range(seq.num_computed_tokens):
                slot = (seq.cpu_block_ids[p // BLOCK], p % BLOCK)
                assert self.cpu_prefix.get(slot) == tuple(seq.token_ids[: p + 1]), f"swapped seq {seq.seq_id} position {p}"
        for seq in self.e.scheduler.waiting:
            assert seq.block_table == [] and seq.cpu_block_ids == [] and seq.status is SeqStatus.WAITING


@pytest.mark.parametrize("round_", range(3))
def test_fuzzed_workload_with_shadow_kv(tiny_model_dir, round_):
    fuzz(tiny_model_dir, random.randrange(1 << 30))


@pytest.mark.parametrize("round_", range(2))
def test_fuzzed_workload_with_speculation(tiny_model_dir, round_):
    fuzz(tiny_model_dir, random.randrange(1 << 30), speculate=True)


def fuzz(tiny_model_dir, seed: int, speculate: bool = False) -> None:
    rng = random.Random(seed)
    spec = None
    if speculate:
        lo = rng.randint(1, 2)
        spec = {"method": "ngram", "num_speculative_tokens": rng.randint(1, 6), "prompt_lookup_min": lo, "prompt_lookup_max": lo + rng.randint(0, 2)}
    chunked = rng.random() < 0.75
    budget = rng.choice([8, 16, 64])
    e = LLMEngine(EngineConfig(
        model=str(tiny_model_dir),
        block_size=BLOCK,
        kv_cache_memory=rng.randint(14, 28) * BLOCK_BYTES_TINY,
        swap_space=rng.choice([0, 6, 40]) * BLOCK_BYTES_TINY,
        max_num_batched_tokens=budget,
        max_num_seqs=rng.choice([2, 4, 16]),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=rng.random() < 0.8,
        speculative_config=spec,
    ))
    shadow = Shadow(e, rng, fault_rate=0.03)
    prefixes = [[rng.randrange(100, 40000) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    max_prompt = 40 if chunked else budget
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    aborted: set[str] = set()
    finished: dict[str, object] = {}
    poison_id = f"r{rng.randrange(20)}"
    for step in range(4000):
        if len(requests) < 20 and rng.random() < 0.3:
            rid = f"r{len(requests)}"
            prompt = (rng.choice(prefixes) + [rng.randrange(100, 40000) for _ in range(rng.randint(1, 26))])[:max_prompt]
            if rid == poison_id:
                prompt[-1] = POISON
            params = SamplingParams(n=rng.choice([1, 1, 1, 2, 3]), max_tokens=rng.randint(1, 20 if speculate else 12), temperature=rng.choice([0, 1.0]), seed=rng.randrange(100), ignore_eos=True)
            deadline = rng.choice([None, None, None, None, time.time() - 1, time.time() + 3600])  # deterministic
            e.add_request(rid, prompt, params, priority=rng.randint(0, 2), deadline=deadline)
            requests[rid] = (prompt, params)
        if e.requests and rng.random() < 0.02:
            rid = rng.choice(sorted(e.requests))
            e.abort(rid)
            aborted.add(rid)
        for req in e.step():
            if req.finished:
                finished[req.request_id] = req
        shadow.check()
        if len(requests) == 20 and not e.has_unfinished():
            break
    assert not e.has_unfinished(), f"seed {seed}: stuck with {sorted(e.requests)}"
    stats = e.stats()
    assert stats["kv_blocks_used"] == 0 and stats["cpu_swap_blocks_used"] == 0, f"seed {seed}: {stats}"
    assert all(b.ref_count == 0 for b in e.kv.pool.blocks)
    if speculate:
        assert stats["spec_decode_num_drafts"] > 0, f"seed {seed}: nothing was drafted"

    if poison_id not in aborted and finished[poison_id].error_code != "deadline_exceeded":
        assert finished[poison_id].error_code == "engine_error", f"seed {seed}"
    lone_failures = [rid for rid, r in finished.items() if r.error_code == "engine_error" and rid != poison_id]
    assert len(lone_failures) <= shadow.faults, f"seed {seed}: {lone_failures} failed, {shadow.faults} faults"
    # the reference: the same requests in one batch, no failures, no preemption
    ref = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=BLOCK, kv_cache_memory=400 * BLOCK_BYTES_TINY, enable_prefix_caching=False))
    compare = [rid for rid, r in finished.items() if r.error_code is None and rid not in aborted]
    for rid in compare:
        ref.add_request(rid, *requests[rid])
    want = {}
    while ref.has_unfinished():
        want.update((r.request_id, r) for r in ref.step() if r.finished)
    for rid in compare:
        got = [s.output_token_ids for s in sorted(finished[rid].seqs, key=lambda s: s.index)]
        exp = [s.output_token_ids for s in sorted(want[rid].seqs, key=lambda s: s.index)]
        assert got == exp, f"seed {seed}: {rid} differs from the failure-free batch"
