"""How each weight is split across the ranks of a tensor-parallel group (Megatron-style).

* Attention: each rank holds a contiguous range of KV heads and every query head that reads them
  (so each rank's GQA group size is the model's). Ranges may be uneven (9 heads / 3 KV heads over
  2 ranks: rank 0 gets KV heads 0-1 and query heads 0-5, rank 1 KV head 2 and query heads 6-8);
  with fewer KV heads than ranks each KV head is replicated on ``world / num_kv_heads`` ranks that
  split its query heads. q/k/v (and their biases) are column-parallel; ``o`` is row-parallel (its
  input columns follow the query heads) and its bias is added on rank 0 only.
* Dense MLP: ``gate``/``up`` rows (and their biases) and ``down`` columns split over the
  intermediate dim, ``down``'s bias on rank 0 only; MoE: the same inside every expert (the router
  is replicated, each rank routes identically). Per-head q/k norms follow their heads.
* Embedding and the final norm: replicated. LM head: on the leader (rank 0) only; followers never
  compute logits (see :class:`FollowerHead`).

After each row-parallel projection (``o``, ``down``, a MoE block) the ranks' partial sums are
all-reduced, so every rank holds the same residual stream. Invariant: rank ``r`` of ``world`` gets
the same ranges whichever process computes them (all ranks call :func:`plan` on the same config).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from qworker.model.families.spec import DenseMLP, Dims, RawLayer


def split_even(n: int, parts: int, index: int) -> range:
    """The ``index``-th of ``parts`` contiguous ranges covering ``range(n)``, sizes differing by at
    most one (the first ranges take the remainder)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (1 if index < extra else 0))


@dataclass(frozen=True, slots=True)
class Plan:
    """One rank's share of the attention: its query heads and KV heads (global indices)."""

    rank: int
    world: int
    q_heads: range
    kv_heads: range


def plan(d: Dims, rank: int, world: int) -> Plan:
    """Which heads ``rank`` holds; a ValueError that says why for a split that cannot work."""
    nq, nkv = d.num_heads, d.num_kv_heads
    if nq % nkv:
        raise ValueError(f"num_attention_heads ({nq}) is not a multiple of num_key_value_heads ({nkv})")
    group = nq // nkv
    if nkv >= world:  # whole KV groups per rank, as evenly as possible
        kv = split_even(nkv, world, rank)
        return Plan(rank, world, range(kv.start * group, kv.stop * group), kv)
    # fewer KV heads than ranks: each KV head replicated on world/nkv ranks splitting its query heads
    if world % nkv or group % (world // nkv):
        raise ValueError(f"tensor_parallel_size={world} cannot split {nq} query heads / {nkv} KV heads: with fewer KV heads "
                         f"than ranks the ranks must be a multiple of the KV heads ({nkv}) and each KV head's {group} query "
                         f"heads a multiple of the ranks per KV head")
    per = world // nkv
    kv_head = rank // per
    q = split_even(group, per, rank % per)
    return Plan(rank, world, range(kv_head * group + q.start, kv_head * group + q.stop), range(kv_head, kv_head + 1))


def _rows(t: torch.Tensor, r: range, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, r.start, len(r)).contiguous()


def _gate_up_rows(t: torch.Tensor, inter: int, r: range, dim: int = 0) -> torch.Tensor:
    """Fused gate/up rows (``2 * inter`` along ``dim``: gate, then up) cut to intermediate range
    ``r``: its gate rows, then its up rows."""
    return torch.cat([_rows(t, r, dim), _rows(t, range(inter + r.start, inter + r.stop), dim)], dim=dim)


class Sharder:
    """Slices a family's :class:`RawLayer` (checked full-size by the family reader) to this rank's
    share and moves it to ``device``. ``refuse`` names spec features that TP cannot serve."""

    def __init__(self, d: Dims, rank: int, world: int, device: torch.device):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world}")
        self.d = d
        self.rank, self.world = rank, world
        self.device = device
        self.plan = plan(d, rank, world)

    @property
    def num_heads(self) -> int:
        return len(self.plan.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.plan.kv_heads)

    def _move(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(self.device)

    def layer(self, raw: RawLayer) -> RawLayer:
        d, p = self.d, self.plan
        hd = d.head_dim
        q_cols = range(p.q_heads.start * hd, p.q_heads.stop * hd)
        kv_cols = range(p.kv_heads.start * hd, p.kv_heads.stop * hd)
        k_off, v_off = d.q_size, d.q_size + d.kv_size

        def qkv_part(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([_rows(t, q_cols), _rows(t, range(k_off + kv_cols.start, k_off + kv_cols.stop)),
                              _rows(t, range(v_off + kv_cols.start, v_off + kv_cols.stop))])

        mlp = raw.mlp
        if isinstance(mlp, DenseMLP):
            mlp = self._dense(mlp)
        else:
            inter = mlp.down.shape[2]
            r = split_even(inter, self.world, self.rank)
            m = self._move
            # replace(): every routing field carries over (a router built afresh would drop new ones)
            mlp = replace(mlp, router=m(mlp.router), gate_up=m(_gate_up_rows(mlp.gate_up, inter, r, 1)), down=m(_rows(mlp.down, r, 2)),
                          # the shared expert splits as a dense MLP; its gate stays whole (a scalar per token)
                          shared=self._dense(mlp.shared) if mlp.shared is not None else None,
                          shared_gate=m(mlp.shared_gate), router_bias=m(mlp.router_bias), choice_bias=m(mlp.choice_bias),
                          gate_up_bias=m(_gate_up_rows(mlp.gate_up_bias, inter, r, 1)) if mlp.gate_up_bias is not None else None,
                          # added once, to the all-reduced sum
                          down_bias=m(mlp.down_bias) if mlp.down_bias is not None and self.rank == 0 else None)
        m = self._move
        return RawLayer(
            input_norm=m(raw.input_norm),
            qkv=m(qkv_part(raw.qkv)),
            qkv_bias=m(qkv_part(raw.qkv_bias)) if raw.qkv_bias is not None else None,
            o=m(_rows(raw.o, q_cols, 1)),
            o_bias=m(raw.o_bias) if raw.o_bias is not None and self.rank == 0 else None,
            mlp_norm=m(raw.mlp_norm),
            mlp=mlp,
            sinks=m(_rows(raw.sinks, p.q_heads)) if raw.sinks is not None else None,
            q_norm=m(self._head_norm(raw.q_norm, p.q_heads)),
            k_norm=m(self._head_norm(raw.k_norm, p.kv_heads)),
            attn_out_norm=m(raw.attn_out_norm),
            mlp_out_norm=m(raw.mlp_out_norm),
        )


    def _dense(self, mlp: DenseMLP) -> DenseMLP:
        """This rank's slice of the intermediate: gate and up rows (and biases), down columns; the
        down bias on rank 0 only (it is added once to the all-reduced sum)."""
        inter = mlp.down.shape[1]
        r = split_even(inter, self.world, self.rank)

        def up_part(t: torch.Tensor) -> torch.Tensor:
            return _gate_up_rows(t, inter, r) if mlp.gated else _rows(t, r)

        m = self._move
        return DenseMLP(m(up_part(mlp.gate_up)), m(_rows(mlp.down, r, 1)), mlp.gated,
                        up_bias=m(up_part(mlp.up_bias)) if mlp.up_bias is not None else None,
                        down_bias=m(mlp.down_bias) if mlp.down_bias is not None and self.rank == 0 else None)

    @staticmethod
    def _head_norm(t: torch.Tensor | None, heads: range) -> torch.Tensor | None:
        """A q/k norm: one for every head (``[head_dim]``) whole; per-head ones (``[2, heads,
        head_dim]``, qk_norm "head_layer") sliced to this rank's heads."""
        return _rows(t, heads, 1) if t is not None and t.dim() == 3 else t


class RowParallel:
    """A row-parallel projection (or a whole MoE block): this rank's partial output, then the
    all-reduce that sums the ranks' partials in place. Every rank gets the same sum."""

    __slots__ = ("inner", "all_reduce")

    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor], all_reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.inner, self.all_reduce = inner, all_reduce

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.inner(x))

    def __getattr__(self, name: str):  # e.g. ``weight`` or ``dense_out_in`` of the wrapped Linear
        return getattr(self.inner, name)


class FollowerHead:
    """A follower's LM head: logits live on the leader only, so a follower asks for none (its
    ``logits_indices`` is empty) and this returns an empty ``[0, vocab]``."""

    def __init__(self, vocab: int, dtype: torch.dtype, device: torch.device):
        self.out_features = vocab
        self._empty = torch.empty((0, vocab), dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._empty


def unsupported(spec) -> str | None:
    """A family feature that needs the whole query width on one rank, or None."""
    if spec.qk_norm == "full":  # OLMoE, OLMo 2/3: RMSNorm over all of q's and k's heads at once
        return "a q/k norm over the full projection width (OLMoE, OLMo 2/3)"
    if spec.rope_dim is not None:  # only MLA sets it; its latent projections would each need a split of their own
        return "DeepSeek's multi-head latent attention (MLA)"
    return None


def wrap(model, all_reduce: Callable[[torch.Tensor], torch.Tensor], leader: bool) -> None:
    """Turns a :class:`~qworker.model.decoder.DecoderModel` built from sharded layers into its
    rank's part: row-parallel ``o``, ``down`` (the dense MLP shares it) and MoE blocks all-reduce;
    a follower's LM head is dropped."""
    from qworker.model.decoder import GatedMLP

    for layer in model.layers:
        layer.o = RowParallel(layer.o, all_reduce)
        if layer.down is not None:
            layer.down = RowParallel(layer.down, all_reduce)
            if isinstance(layer.mlp, GatedMLP):
                layer.mlp.down = layer.down
        else:
            layer.mlp = RowParallel(layer.mlp, all_reduce)
    if not leader:
        model.lm_head = FollowerHead(model.vocab_size, model.act_dtype, model.device)
