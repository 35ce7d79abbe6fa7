"""The Triton wrappers refuse what their kernels cannot take as given (helper-77: a too-small
``out`` was written past its end and corrupted the heap; strided index tensors, a short weight,
a mismatched value or expert tensor were read out of bounds into wrong numbers). Each case here
computed garbage or crashed before; now it is a ``KernelInputError`` naming the argument, and
the well-formed call beside it still matches its reference. Runs under the interpreter on CPU."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import assert_close, generator, make_paged_batch

import kernels
from kernels.contracts import KernelInputError


@pytest.fixture
def batch(device):
    return make_paged_batch(generator(3), lens=[20, 7, 33], q_lens=[1, 1, 1], block_size=16, num_kv_heads=2, group=2,
                            head_dim=64, dtype=torch.float32, device=device).finite()


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view with stride 2."""
    return torch.stack([t, t], dim=-1).flatten()[::2].view(t.shape) if t.dim() == 1 else t.t().contiguous().t()


def test_decode_refuses_bad_out_and_index_layouts(batch) -> None:
    q, kc, vc, bt, sl, scale = batch.decode_args()
    want = kernels.paged_decode_attention_ref(q, kc, vc, bt, sl, scale)
    assert_close(kernels.paged_decode_attention(q, kc, vc, bt, sl, scale, num_splits=2), want, torch.float32, "decode")
    big = torch.zeros(4, *q.shape[1:])
    for out in (big[:2], big[:3, :, ::2], torch.zeros_like(q, dtype=torch.float16)):
        with pytest.raises(KernelInputError, match="out"):
            kernels.paged_decode_attention(q, kc, vc, bt, sl, scale, out=out)
    assert not big.any(), "nothing written"
    with pytest.raises(KernelInputError, match="seq_lens"):
        kernels.paged_decode_attention(q, kc, vc, bt, _strided(sl), scale)
    with pytest.raises(KernelInputError, match="block_tables"):
        kernels.paged_decode_attention(q, kc, vc, _strided(bt), sl, scale)
    with pytest.raises(KernelInputError, match="block_tables"):
        kernels.paged_decode_attention(q, kc, vc, bt[:2], sl, scale)
    with pytest.raises(KernelInputError, match="one dtype"):  # was an interpreter assertion deep in tl.dot
        kernels.paged_decode_attention(q, kc.half(), vc.half(), bt, sl, scale)


@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_decode_of_an_empty_sequence_is_zeros_whatever_the_split(batch, num_splits: int) -> None:
    """seq_len 0 gave zeros with one split and NaN with several (no live split to merge)."""
    q, kc, vc, bt, sl, scale = batch.decode_args()
    sl = sl.clone()
    sl[1] = 0
    out = kernels.paged_decode_attention(q, kc, vc, bt, sl, scale, num_splits=num_splits, block_n=16)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_close(out, kernels.paged_decode_attention_ref(q, kc, vc, bt, sl, scale), torch.float32, "decode, an empty sequence")


def test_prefill_refuses_bad_out_and_index_layouts(device) -> None:
    b = make_paged_batch(generator(4), lens=[20, 9], q_lens=[6, 9], block_size=16, num_kv_heads=2, group=2, head_dim=64,
                         dtype=torch.float32, device=device).finite()
    q, kc, vc, bt, qsl, sl, scale, mq = b.args()
    assert_close(kernels.paged_prefill_attention(*b.args()), kernels.paged_prefill_attention_ref(*b.args()), torch.float32, "prefill")
    big = torch.zeros(q.shape[0] + 5, *q.shape[1:])
    with pytest.raises(KernelInputError, match="out"):
        kernels.paged_prefill_attention(*b.args(), out=big[:10])
    assert not big.any()
    for args, name in (((q, kc, vc, bt, _strided(qsl), sl), "query_start_loc"), ((q, kc, vc, bt, qsl, _strided(sl)), "seq_lens"),
                       ((q, kc, vc, _strided(bt), qsl, sl), "block_tables")):
        with pytest.raises(KernelInputError, match=name):
            kernels.paged_prefill_attention(*args, scale, mq)


def test_store_kv_refuses_a_value_of_another_shape_and_a_strided_slot_mapping(device) -> None:
    kc = torch.zeros(4, 16, 2, 64, device=device)
    vc = torch.zeros_like(kc)
    key, value = torch.randn(3, 2, 64, device=device), torch.randn(3, 2, 64, device=device)
    slots = torch.tensor([5, 17, 40], device=device)
    with pytest.raises(KernelInputError, match="value"):
        kernels.store_kv(key, value[:, :1], kc, vc, slots)
    with pytest.raises(KernelInputError, match="slot_mapping"):
        kernels.store_kv(key, value, kc, vc, _strided(slots))
    with pytest.raises(KernelInputError, match="slot_mapping"):
        kernels.store_kv(key, value, kc, vc, slots[:2])
    assert not kc.any() and not vc.any()
    kernels.store_kv(key, value, kc, vc, slots)
    assert torch.equal(kc.view(-1, 2, 64)[slots], key) and torch.equal(vc.view(-1, 2, 64)[slots], value)


def test_rms_norm_refuses_a_short_weight_and_an_odd_residual(device) -> None:
    x, w = torch.randn(4, 64, device=device), torch.randn(64, device=device)
    res = torch.randn(64, 4, device=device).t()  # strided last dim
    for bad in ((x, w[:32], None), (x, w, res), (x, w, res.contiguous().half()), (x, w, res.contiguous()[:2])):
        with pytest.raises(KernelInputError):
            kernels.rms_norm(bad[0], bad[1], 1e-5, bad[2])
    got = kernels.rms_norm(x, w, 1e-5, res.contiguous())
    want = kernels.rms_norm_ref(x, w, 1e-5, res.contiguous())
    assert_close(got[0], want[0], torch.float32, "rms norm")
    assert_close(got[1], want[1], torch.float32, "new residual")


def test_moe_refuses_mismatched_experts_routing_and_ids(device) -> None:
    from kernels.fused_moe import moe_experts
    from kernels.moe_reference import moe_experts_ref

    gen = generator(5)
    T, H, I, E, K = 4, 32, 48, 4, 2
    x = torch.randn(T, H, generator=gen).to(device)
    gate_up, down = torch.randn(E, 2 * I, H, generator=gen).to(device), torch.randn(E, H, I, generator=gen).to(device)
    ids = torch.randint(0, E, (T, K), generator=gen).to(device)
    w = torch.rand(T, K, generator=gen).to(device)
    assert_close(moe_experts(x, gate_up, down, w, ids), moe_experts_ref(x, gate_up, down, w, ids), torch.float32, "moe")
    for args in ((x, gate_up, down[:, :, : I // 2], w, ids), (x, gate_up, down, w[:, :1], ids),
                 (torch.randn(T, H + 16).to(device), gate_up, down, w, ids)):
        with pytest.raises(KernelInputError):
            moe_experts(*args)
    with pytest.raises(ValueError, match="num_experts"):
        moe_experts(x, gate_up, down, w, torch.full_like(ids, E))
