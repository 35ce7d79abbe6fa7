"""The sharding math of every family, in one process and without torch.distributed: the ranks
of a group run as threads of this process, each its own shard (``ModelRunner(tp=...)``) and KV
pool, joined by an all-reduce over shared buffers (summed in rank order, as gloo does for two).
Rank 0's logits must equal one unsharded model's, for a prefill and then a decode step over the
written KV: q/k/v biases (Qwen2), q/k norms per head (Qwen3, Gemma 3), the norms Gemma puts after
o and down, soft-caps, fused checkpoints (Phi-3), MoE experts (Mixtral, Qwen3-MoE), Granite's
residual and logit scales, SmolLM3's NoPE layers, and a KV head
replicated on two ranks (four ranks over two KV heads). The real process group is tested in
test_tensor_parallel.py; this covers the families cheaply (no process is started)."""

from __future__ import annotations

import threading

import pytest
import torch

from qworker.model.batch import Batch, SeqChunk
from qworker.model.families import spec_for
from qworker.model.parallel import shard
from qworker.model.parallel.build import TPRank
from qworker.model.runner import ModelRunner
from tests.engine.family_models import FAMILIES, family_config

# every family the sharder takes (the full-width q/k norm of OLMoE and OLMo 2/3 is refused)
CASES = [(f, 2) for f in FAMILIES if shard.unsupported(spec_for(family_config(f))) is None] + [("llama", 4)]


class ThreadGroup:
    """An all-reduce for ``world`` threads: every rank's tensor summed in rank order, in place."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.bufs: list[torch.Tensor | None] = [None] * world

    def all_reduce_for(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.bufs[rank] = t
            self.barrier.wait()
            total = self.bufs[0].clone()
            for b in self.bufs[1:]:
                total += b
            self.barrier.wait()  # everyone has read every buffer before any is overwritten
            t.copy_(total)
            return t
        return all_reduce


def run_ranks(runners: list[ModelRunner], batch: Batch) -> list[torch.Tensor]:
    out: list = [None] * len(runners)
    errors: list[BaseException] = []

    def go(r):
        try:
            out[r] = runners[r].execute(batch)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in range(len(runners))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("family,world", CASES, ids=[f"{f}-tp{w}" for f, w in CASES])
def test_rank0_logits_equal_the_whole_model(family_models, family, world):
    path = family_models.get(family)
    group = ThreadGroup(world)
    whole = ModelRunner(path, "cpu", "float32")
    ranks = [ModelRunner(path, "cpu", "float32", tp=TPRank(r, world, group.all_reduce_for(r))) for r in range(world)]
    for r in [whole, *ranks]:
        r.allocate_kv_cache(8, 0, 16)
    prompts = [[5, 17, 99, 1024, 7, 300, 41, 8, 12, 2048, 33, 71, 9, 64, 128, 256, 77, 19, 3000, 45, 6],
               [400, 401, 402, 403, 404]]
    tables = [[0, 1], [2]]
    prefill = Batch([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables)])
    want = whole.execute(prefill)
    got = run_ranks(ranks, prefill)
    assert all(g.shape[0] == 0 for g in got[1:])  # followers compute no logits
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-4)
    nxt = want.argmax(-1).tolist()
    decode = Batch([SeqChunk([n], len(p), t, True) for n, p, t in zip(nxt, prompts, tables)])
    want = whole.execute(decode)
    torch.testing.assert_close(run_ranks(ranks, decode)[0], want, rtol=1e-4, atol=1e-4)
    assert got[0].argmax(-1).tolist() == nxt


def test_three_ranks_over_two_kv_heads_is_refused(family_models):
    with pytest.raises(ValueError, match="cannot split"):
        ModelRunner(family_models.get("llama"), "cpu", "float32", tp=TPRank(0, 3, lambda t: t))
