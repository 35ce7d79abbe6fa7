"""The Triton multi-LoRA shrink/expand (kernels.lora_sgmv) against their torch references, under the
interpreter on CPU (natively on CUDA): mixed slots, base-model (-1) segments, gaps between
segments, empty segments, decode's one-row segments, every supported rank, fused projections of 1-3
slices, sizes that are not multiples of the tiles; what must stay untouched stays bit-identical;
and the segment-to-tile map the kernels read."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import kernels
from kernel_testlib import ON_CUDA, assert_close, generator

if not ON_CUDA and "kernels.lora_sgmv" in sys.modules:  # imported compiled by an earlier test
    importlib.reload(sys.modules["kernels.lora_sgmv"])


def _segments(gen, T: int, S: int, one_row: bool = False):
    """Random disjoint segments over [0, T): lengths 0..12 (1 each for decode), random slots in
    [-1, S), an occasional gap of rows in no segment. Returns host lists."""
    starts, lens, slots = [], [], []
    at = 0
    while at < T:
        if not one_row and torch.rand(1, generator=gen).item() < 0.15:
            at += 1  # a row in no segment
            continue
        n = 1 if one_row else int(torch.randint(0, 13, (1,), generator=gen))
        n = min(n, T - at)
        starts.append(at)
        lens.append(n)
        slots.append(int(torch.randint(-1, S, (1,), generator=gen)))
        at += n
    return starts, lens, slots


def _seg_tensors(starts, lens, slots, device):
    return tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in (starts, lens, slots))


def _stacks(gen, S, n, R, rank, in_dim, outs, dtype, device):
    """A stack of ``n * R`` rows per slot whose rows past ``rank`` in each slice are zero (a lower
    rank padded to the max), and one B stack per slice (columns past ``rank`` zero)."""
    a = torch.randn(S, n, R, in_dim, generator=gen) / in_dim**0.5
    a[:, :, rank:] = 0
    bs = []
    for out in outs:
        b = torch.randn(S, out, R, generator=gen) / rank**0.5
        b[:, :, rank:] = 0
        bs.append(b.to(dtype).to(device))
    return a.reshape(S, n * R, in_dim).to(dtype).to(device), bs


def _covered_rows(starts, lens, slots, T):
    """Rows an adapter runs on (slot >= 0)."""
    mask = torch.zeros(T, dtype=torch.bool)
    for s, n, slot in zip(starts, lens, slots):
        if slot >= 0:
            mask[s:s + n] = True
    return mask


CASES = [
    # (T, S, n, R, rank, in, outs, one_row, block_n, block_k)
    (37, 3, 3, 16, 16, 40, (24, 8, 8), False, 16, 16),  # fused qkv (GQA), in not a multiple of BLOCK_K
    (29, 4, 2, 8, 8, 48, (40, 40), False, None, None),  # gate_up, rank 8 (< tl.dot's 16), launcher tiles
    (9, 2, 1, 32, 20, 24, (33,), True, 16, 16),  # decode: one-row segments, rank 20 padded to 32
    (21, 3, 1, 64, 64, 72, (50,), False, 32, None),  # rank 64, several N tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-n{c[2]}-R{c[3]}")
def test_shrink_expand_match_reference(seed, device, dtype, case):
    if dtype == torch.bfloat16 and not ON_CUDA:
        pytest.skip("bf16 is not supported by Triton's CPU interpreter (numpy has no bfloat16)")
    T, S, n, R, rank, in_dim, outs, one_row, bn, bk = case
    gen = generator(seed)
    starts, lens, slots = _segments(gen, T, S, one_row)
    seg = _seg_tensors(starts, lens, slots, device)
    a, bs = _stacks(gen, S, n, R, rank, in_dim, outs, dtype, device)
    x = torch.randn(T, in_dim, generator=gen).to(dtype).to(device)
    covered = _covered_rows(starts, lens, slots, T)
    what = f"segments {list(zip(starts, lens, slots))}"

    h = kernels.lora_shrink(x, a, *seg, block_n=bn, block_k=bk)
    h_ref = kernels.lora_shrink_ref(x, a, *seg)
    assert h.dtype == torch.float32 and h.shape == (T, n * R)
    assert_close(h, h_ref, dtype, f"shrink, {what}")
    assert (h.cpu()[~covered] == 0).all(), "rows with no adapter must be zero"

    pad = 3  # y has columns outside every slice: they must stay untouched
    y0 = torch.randn(T, sum(outs) + pad, generator=gen).to(dtype).to(device)
    y, y_ref = y0.clone(), y0.clone()
    off = 0
    for i, (b, out) in enumerate(zip(bs, outs)):
        hi = h[:, i * R:(i + 1) * R]  # a strided view, as the model passes it
        kernels.lora_expand(hi, b, *seg, y, off, block_n=bn)
        kernels.lora_expand_ref(hi, b, *seg, y_ref, off)
        off += out
    assert_close(y, y_ref, dtype, f"expand, {what}")
    assert torch.equal(y.cpu()[~covered], y0.cpu()[~covered]), "rows with no adapter must be untouched"
    assert torch.equal(y[:, off:], y0[:, off:]), "columns outside the slices must be untouched"
    if covered.any() and rank > 0:
        assert not torch.equal(y.cpu()[covered], y0.cpu()[covered]), "the adapters must move the outputs"


def test_split_k_and_shared_tiles(seed, device):
    """A K-split shrink (atomic partial sums) and one tile map built once for a whole step with a
    non-default BLOCK_M, as the model passes it to every call."""
    gen = generator(seed)
    T, S, R, in_dim, out = 45, 3, 16, 100, 36
    starts, lens, slots = _segments(gen, T, S)
    seg = _seg_tensors(starts, lens, slots, device)
    a, (b,) = _stacks(gen, S, 1, R, R, in_dim, (out,), torch.float32, device)
    x = torch.randn(T, in_dim, generator=gen).to(device)
    tiles = kernels.lora_tiles(*seg, T, 32)
    h_ref = kernels.lora_shrink_ref(x, a, *seg)
    for split in (1, 3):
        h = kernels.lora_shrink(x, a, *seg, tiles=tiles, block_k=16, split_k=split)
        assert_close(h, h_ref, torch.float32, f"split_k={split}")
    y = torch.randn(T, out, generator=gen).to(device)
    y_ref = y.clone()
    kernels.lora_expand(h, b, *seg, y, 0, tiles=tiles, block_n=16)
    kernels.lora_expand_ref(h, b, *seg, y_ref, 0)
    assert_close(y, y_ref, torch.float32, "expand with shared tiles")


def test_no_adapter_work_is_harmless(device):
    """No segments, only base-model segments, zero-length segments, no tokens: h is zero and y is
    untouched."""
    x = torch.randn(7, 24, device=device)
    a = torch.randn(2, 16, 24, device=device)
    b = torch.randn(2, 10, 16, device=device)
    y = torch.randn(7, 10, device=device)
    y0 = y.clone()
    for starts, lens, slots in (([], [], []), ([0, 3], [3, 4], [-1, -1]), ([2, 2], [0, 0], [0, 1])):
        seg = _seg_tensors(starts, lens, slots, device)
        h = kernels.lora_shrink(x, a, *seg)
        assert h.shape == (7, 16) and (h == 0).all()
        kernels.lora_expand(h, b, *seg, y, 0)
        assert torch.equal(y, y0)
    seg = _seg_tensors([0], [0], [1], device)
    empty = kernels.lora_shrink(x[:0], a, *seg)
    assert empty.shape == (0, 16)
    kernels.lora_expand(empty, b, *seg, y[:0], 0)


def test_tile_map_covers_each_adapter_row_once(seed):
    """Every row of every slot >= 0 segment is in exactly one tile of its own segment; slot -1 and
    empty segments get none; tiles past the last are -1; the bound holds for decode's 1-row
    segments."""
    gen = generator(seed)
    T, bm = 70, 16
    starts, lens, slots = _segments(gen, T, 4)
    tiles = kernels.lora_tiles(*_seg_tensors(starts, lens, slots, "cpu"), T, bm)
    assert tiles.block_m == bm and tiles.tile_seg.numel() == -(-T // bm) + len(starts)
    seen = []
    live = tiles.tile_seg >= 0
    assert not live[live.long().sum():].any(), "live tiles come first"
    for seg, row in zip(tiles.tile_seg[live].tolist(), tiles.tile_row[live].tolist()):
        assert slots[seg] >= 0 and row % bm == 0 and row < lens[seg]
        seen += [(seg, r) for r in range(row, min(row + bm, lens[seg]))]
    expect = [(g, r) for g, (n, slot) in enumerate(zip(lens, slots)) if slot >= 0 for r in range(n)]
    assert sorted(seen) == expect
    decode = kernels.lora_tiles(*_seg_tensors(list(range(64)), [1] * 64, [i % 4 for i in range(64)], "cpu"), 64, 16)
    assert decode.tile_seg.numel() == 68 and decode.tile_seg[:64].tolist() == list(range(64))
