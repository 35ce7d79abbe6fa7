"""The torch references (the CPU engine's attention) against the per-token oracle.

No Triton here: these run on CPU in plain torch, so they can afford more
shapes. Inputs are float64 (tight check of the math) and float32 (what the
CPU engine runs).
"""

from __future__ import annotations

import pytest
import torch

from kernel_testlib import (
    assert_close,
    generator,
    make_paged_batch,
    oracle_attention,
    poisoned_like,
    random_lens,
)

from kernels import (
    paged_attention_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    rms_norm_ref,
    store_kv_ref,
)

SHAPES = [  # (block_size, Hkv, G, D)
    (16, 2, 3, 64),
    (16, 1, 8, 64),
    (32, 2, 4, 64),
    (16, 3, 1, 128),
    (32, 1, 3, 128),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bs,hkv,g,d", SHAPES)
def test_decode_ref_matches_oracle(seed, bs, hkv, g, d, dtype):
    gen = generator(seed)
    lens = random_lens(gen, 5, bs, 3 * bs + 5)
    batch = make_paged_batch(gen, lens=lens, q_lens=[1] * len(lens), block_size=bs, num_kv_heads=hkv,
                             group=g, head_dim=d, dtype=dtype, device="cpu", poison=0.0)
    out = paged_decode_attention_ref(*batch.decode_args(), out=poisoned_like(batch.q))
    assert_close(out, oracle_attention(batch), dtype, f"decode ref {lens}")
    # Returned (not in-place) form gives the same result in q's dtype.
    again = paged_decode_attention_ref(*batch.decode_args())
    assert again.dtype == dtype and torch.equal(again, out)


def _mixed_q_lens(gen: torch.Generator, lens: list[int]) -> list[int]:
    """Per sequence: a decode row, the whole prompt, or a chunk after a cached prefix."""
    q_lens = []
    for i, L in enumerate(lens):
        kind = (i + int(torch.randint(0, 3, (1,), generator=gen))) % 3
        q_lens.append(1 if kind == 0 else L if kind == 1 else int(torch.randint(1, L + 1, (1,), generator=gen)))
    return q_lens


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bs,hkv,g,d", SHAPES)
def test_prefill_ref_matches_oracle(seed, bs, hkv, g, d, dtype):
    gen = generator(seed)
    lens = random_lens(gen, 6, bs, 3 * bs + 5)
    q_lens = _mixed_q_lens(gen, lens)
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=bs, num_kv_heads=hkv,
                             group=g, head_dim=d, dtype=dtype, device="cpu", poison=0.0)
    out = paged_prefill_attention_ref(*batch.args(), out=poisoned_like(batch.q))
    assert_close(out, oracle_attention(batch), dtype, f"prefill ref lens={lens} q_lens={q_lens}")


def test_prefix_cached_chunks_see_their_prefix(seed):
    """A chunk after a cached prefix must attend the prefix: its output differs
    from attending the chunk alone, and matches the oracle."""
    gen = generator(seed)
    lens, q_lens = [40, 33], [7, 16]
    batch = make_paged_batch(gen, lens=lens, q_lens=q_lens, block_size=16, num_kv_heads=2, group=2,
                             head_dim=64, dtype=torch.float64, device="cpu", poison=0.0)
    out = paged_prefill_attention_ref(*batch.args())
    assert_close(out, oracle_attention(batch), torch.float64, "prefix-cached chunks")
    # Top-left causal alignment (the classic bug: row i sees 0..i, not prefix..prefix+i) differs.
    t = batch.tables[0]
    k = batch.k_cache[t].reshape(-1, 2, 64)[:40].transpose(0, 1)
    v = batch.v_cache[t].reshape(-1, 2, 64)[:40].transpose(0, 1)
    bug = torch.nn.functional.scaled_dot_product_attention(
        batch.q[:7].transpose(0, 1), k, v, is_causal=True, scale=batch.scale, enable_gqa=True
    ).transpose(0, 1)
    assert (bug - out[:7]).abs().max() > 1e-3


def test_paged_attention_ref_routes(seed):
    gen = generator(seed)
    lens = random_lens(gen, 4, 16, 50)
    dec = make_paged_batch(gen, lens=lens, q_lens=[1] * 4, block_size=16, num_kv_heads=1, group=4,
                           head_dim=64, dtype=torch.float32, device="cpu", poison=0.0)
    assert_close(paged_attention_ref(*dec.args()), oracle_attention(dec), torch.float32, "route decode")
    mixed = make_paged_batch(gen, lens=lens, q_lens=[1, 1, lens[2], 1], block_size=16, num_kv_heads=1,
                             group=4, head_dim=64, dtype=torch.float32, device="cpu", poison=0.0)
    assert_close(paged_attention_ref(*mixed.args()), oracle_attention(mixed), torch.float32, "route mixed")


def test_oracle_has_teeth(seed):
    """The comparison must fail for a subtly wrong answer: one page of sequence 0
    read from sequence 1 (swapping pages *within* a sequence would not do:
    decode attention is invariant to the order of its keys)."""
    gen = generator(seed)
    batch = make_paged_batch(gen, lens=[40, 35], q_lens=[1, 1], block_size=16, num_kv_heads=1, group=2,
                             head_dim=64, dtype=torch.float64, device="cpu", poison=0.0)
    ref = oracle_attention(batch)
    bt = batch.block_tables.clone()
    bt[0, 1] = bt[1, 0]
    wrong = paged_decode_attention_ref(batch.q, batch.k_cache, batch.v_cache, bt, batch.seq_lens, batch.scale)
    with pytest.raises(AssertionError):
        assert_close(wrong, ref, torch.float64, "swapped pages")
    half = paged_decode_attention_ref(*batch.decode_args())
    half[0, 0, 0] = float("nan")
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(half, ref, torch.float64, "unwritten element")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_ref(seed, dtype):
    gen = generator(seed)
    nb, bs, hkv, d, T = 6, 16, 2, 64, 20
    slots = torch.randperm(nb * bs, generator=gen)[:T]
    slots[torch.randperm(T, generator=gen)[:4]] = -1  # padding tokens
    big = torch.randn(T, 3 * hkv * d, generator=gen)
    key = big[:, hkv * d : 2 * hkv * d].view(T, hkv, d)  # strided view, as sliced from a fused QKV
    value = big[:, 2 * hkv * d :].view(T, hkv, d)
    kc = torch.full((nb, bs, hkv, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    store_kv_ref(key, value, kc, vc, slots)
    want_k = torch.full_like(kc, float("nan")).view(-1, hkv, d)
    want_v = want_k.clone()
    for t in range(T):  # the oracle: one token at a time
        if slots[t] >= 0:
            want_k[slots[t]] = key[t].to(dtype)
            want_v[slots[t]] = value[t].to(dtype)
    torch.testing.assert_close(kc.view(-1, hkv, d), want_k, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(vc.view(-1, hkv, d), want_v, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_ref(seed, with_residual):
    gen = generator(seed)
    x = torch.randn(5, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    r = torch.randn(5, 576, generator=gen) if with_residual else None
    out, new_res = rms_norm_ref(x, w, 1e-5, r)
    h = (x + r if with_residual else x).double()
    want = w.double() * h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_res.double(), h)


def test_import_without_triton():
    """A CPU-only install without triton must still import the package and run the references."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys; sys.modules['triton'] = None\n"  # any `import triton` now raises ImportError
        "import torch, kernels\n"
        "kc = torch.randn(4, 16, 1, 64); q = torch.randn(2, 2, 64)\n"
        "bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32); lens = torch.tensor([20, 3], dtype=torch.int32)\n"
        "out = kernels.paged_decode_attention_ref(q, kc, kc, bt, lens, 0.125)\n"
        "assert out.shape == (2, 2, 64) and not out.isnan().any()\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr
