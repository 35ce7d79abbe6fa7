"""Random paged batches, a per-token float64 oracle, and comparison helpers.

The oracle is deliberately naive: for every query row and every head it looks
each attended token up through the block table one by one and does a softmax
in float64. It shares no code with :mod:`kernels.reference`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NAN = float("nan")
ON_CUDA = torch.cuda.is_available()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, width], padding entries are garbage
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    scale: float
    max_query_len: int
    q_lens: list[int]
    lens: list[int]
    tables: list[list[int]]  # the live blocks of each sequence

    def args(self) -> tuple:
        """Positional args of paged_{prefill_,}attention."""
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.seq_lens, self.scale, self.max_query_len)

    def decode_args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens, self.scale)

    def finite(self) -> "PagedBatch":
        """The same batch with poisoned (non-live) cache slots zeroed, for the references."""
        return PagedBatch(**{**self.__dict__, "k_cache": torch.nan_to_num(self.k_cache, nan=0.0),
                             "v_cache": torch.nan_to_num(self.v_cache, nan=0.0)})


def make_paged_batch(
    gen: torch.Generator,
    *,
    lens: list[int],
    q_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    poison: float = NAN,
) -> PagedBatch:
    """A batch over a cache whose pages are shuffled across sequences.

    Cache slots no sequence owns (spare blocks, tails of last blocks) hold
    ``poison``, so a kernel that reads outside a sequence shows it. Table
    columns past a sequence's last block hold garbage ids, out of range too.
    """
    assert len(lens) == len(q_lens) and all(1 <= ql <= L for ql, L in zip(q_lens, lens))
    need = [cdiv(L, block_size) for L in lens]
    num_blocks = sum(need) + int(torch.randint(1, 4, (1,), generator=gen))
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(ids[at : at + n])
        at += n
    width = max(need) + int(torch.randint(0, 3, (1,), generator=gen))
    bt = torch.randint(-3, num_blocks + 3, (len(lens), width), generator=gen, dtype=torch.int32)
    for b, t in enumerate(tables):
        bt[b, : len(t)] = torch.tensor(t, dtype=torch.int32)

    Hq = num_kv_heads * group
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, poison, dtype=torch.float64)
    v_cache = torch.full(shape, poison, dtype=torch.float64)
    for t, L in zip(tables, lens):
        for j in range(L):
            blk, off = t[j // block_size], j % block_size
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
    T = sum(q_lens)
    q = torch.randn(T, Hq, head_dim, generator=gen, dtype=torch.float64)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    return PagedBatch(
        q=q.to(dtype).to(device),
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        block_tables=bt.to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        scale=1.0 / math.sqrt(head_dim),
        max_query_len=max(q_lens),
        q_lens=list(q_lens),
        lens=list(lens),
        tables=tables,
    )


def random_lens(gen: torch.Generator, n: int, block_size: int, max_len: int) -> list[int]:
    """Context lengths covering the edge cases: 1 token, a whole number of
    blocks, ending mid-block, then random; shuffled."""
    edge = [1, block_size * max(1, max_len // block_size // 2), block_size + 1 + int(torch.randint(0, block_size - 1, (1,), generator=gen))]
    rest = torch.randint(1, max_len + 1, (max(0, n - len(edge)),), generator=gen).tolist()
    lens = [min(x, max_len) for x in (edge + rest)[:n]]
    perm = torch.randperm(len(lens), generator=gen).tolist()
    return [lens[i] for i in perm]


def oracle_attention(batch: PagedBatch, sliding_window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Per query row, per head, per token: float64 ``[T, Hq, D]`` on CPU.

    With ``sliding_window`` a query at position ``pos`` sees the tokens ``j`` with
    ``pos - sliding_window < j <= pos``; with ``softcap`` each score ``s`` becomes
    ``softcap * tanh(s / softcap)`` before the softmax; with ``sinks`` head ``h``'s softmax
    has one more logit, ``sinks[h]``, whose probability multiplies no value."""
    kc = batch.k_cache.double().cpu()
    vc = batch.v_cache.double().cpu()
    q = batch.q.double().cpu()
    bs, Hkv = kc.shape[1], kc.shape[2]
    Hq = q.shape[1]
    G = Hq // Hkv
    out = torch.empty_like(q)
    row = 0
    for table, L, ql in zip(batch.tables, batch.lens, batch.q_lens):
        for i in range(ql):
            pos = L - ql + i  # this query's position; it sees tokens 0..pos (its window of them)
            seen = [j for j in range(pos + 1) if sliding_window is None or pos - j < sliding_window]
            keys = torch.stack([kc[table[j // bs], j % bs] for j in seen])  # [n, Hkv, D]
            vals = torch.stack([vc[table[j // bs], j % bs] for j in seen])
            for h in range(Hq):
                scores = keys[:, h // G] @ q[row, h] * batch.scale
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                if sinks is None:
                    probs = torch.softmax(scores, dim=0)
                else:
                    probs = torch.softmax(torch.cat([scores, sinks[h:h + 1].double().cpu()]), dim=0)[:-1]
                out[row, h] = probs @ vals[:, h // G]
            row += 1
    return out


# (max relative Frobenius error, max abs error) against a reference computed
# from the same rounded inputs.
TOL = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 2e-4),
    torch.float16: (3e-3, 2e-2),
    torch.bfloat16: (2e-2, 8e-2),
}


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Every element written (no NaN left from the poisoned output) and close to ``ref``."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    bad = torch.isnan(out)
    assert not bad.any(), f"{what}: {int(bad.sum())} NaN/unwritten outputs, first at {bad.nonzero()[0].tolist()}"
    o, r = out.double().cpu(), ref.double().cpu()
    rel = ((o - r).norm() / r.norm().clamp_min(1e-30)).item()
    mx = (o - r).abs().max().item() if o.numel() else 0.0
    rtol, atol = TOL[dtype]
    assert rel <= rtol and mx <= atol, f"{what}: rel err {rel:.3g} (tol {rtol}), max abs err {mx:.3g} (tol {atol})"


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, NAN)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def poison_before_window(batch: PagedBatch, sliding_window: int, value: float = NAN) -> tuple[PagedBatch, int]:
    """The batch with every block that lies wholly before all its queries' windows set to ``value``
    (a kernel that skips them, as it must, is unaffected); also returns how many were poisoned.
    Blocks partly inside a window are left alone: masked slots of a visited block may be read."""
    k, v = batch.k_cache.clone(), batch.v_cache.clone()
    bs = k.shape[1]
    poisoned = 0
    for table, L, ql in zip(batch.tables, batch.lens, batch.q_lens):
        first_seen = max(0, L - ql + 1 - sliding_window)  # the first query's first visible key
        for blk in table[: first_seen // bs]:
            k[blk] = value
            v[blk] = value
            poisoned += 1
    return PagedBatch(**{**batch.__dict__, "k_cache": k, "v_cache": v}), poisoned
