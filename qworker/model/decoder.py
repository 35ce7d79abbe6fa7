"""The decoder every family shares (norm -> attention -> norm -> MLP) over a paged KV cache.

A family (:mod:`qworker.model.families`) says what differs as a :class:`DecoderSpec`: weight
names, q/k norms, MLP kind, the norms' form, extra or missing norms, attention options per layer
(window, rope table or none), embedding, residual and logit scales, logit soft-capping. Two
forwards: :meth:`DecoderModel.forward` is the Llama loop, used whenever the spec adds nothing but
one window for all layers (Llama, Mistral, Qwen2 and Ministral without per-layer windows, Phi-3),
so that path does no per-layer work beyond what it always did;
:meth:`DecoderModel._forward_general` carries every hook. On CPU in bf16 mode the Llama loop
is :meth:`DecoderModel._forward_cpu_bf16`: the same values, without the fp32 copies of the bf16
GEMMs' inputs and outputs.

Weights are plain tensors; q/k/v and gate/up projections are fused into one matmul each, because
on every device a few large matmuls beat many small ones. Only the rows that need logits go
through the final norm and the LM head.

Every projection is a :class:`~qworker.model.linear.Linear`: on CUDA ``x @ w`` with ``w`` the
checkpoint's weight as a free transposed view (cuBLAS takes it as is); on CPU oneDNN with the
weight packed once at load, or ``x @ w`` with a row-major ``[in, out]`` copy where oneDNN is
unavailable or slower (chosen at start-up, see :mod:`qworker.model.linear`).
"""

from __future__ import annotations

import logging
import math
import operator
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

import kernels
from kernels.decoder_cpu import DecoderLayers
from kernels.env import switch
from kernels import gemm_cpu
from kernels.greedy_head import BoundedGreedyHead, bounded_head_supported
from qworker.model.attention import AttentionMetadata, PagedAttention, chunked_metadata
from qworker.model.families import spec_for
from qworker.model.families.spec import (DecoderSpec, DenseMLP, LatentAttentionWeights, MoEWeights, RawLayer, dims, no_affine_norm, take,
                                         take_layer_norm)
from qworker.model.latent_attention import HeadPrefix, LatentQKV
from qworker.model.linear import Linear, cpu_linear_backend
from qworker.model.moe import MoE, Routing, SharedExpertMoE
from qworker.model.rope import NoPETemperature, PartialRotaryEmbedding, RotaryEmbedding, rotary_embedding

log = logging.getLogger(__name__)


class GatedMLP:
    """``down(act(gate(x)) * up(x))`` with gate/up fused; ``act`` maps ``[T, 2I]`` -> ``[T, I]``.
    A non-gated MLP (StarCoder 2, Phi, ...) is the same object with ``gate_up`` its up projection
    and ``act`` mapping ``[T, I]`` -> ``[T, I]``: ``down(act(up(x)))``."""

    __slots__ = ("gate_up", "down", "act")

    def __init__(self, gate_up: Linear, down: Linear, act: Callable[[torch.Tensor], torch.Tensor]):
        self.gate_up, self.down, self.act = gate_up, down, act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)))


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


# a non-gated MLP's activation by DecoderSpec.activation
PLAIN_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "relu2": lambda x: F.relu(x).square(),
    "relu": F.relu}


def layer_norm(x: torch.Tensor, weight_bias: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm with the RMSNorm kernels' contract: ``(norm(x + residual), x + residual)``;
    ``weight_bias`` ``[2, H]`` (see :class:`~qworker.model.families.spec.RawLayer`)."""
    total = x if residual is None else x + residual
    return F.layer_norm(total, total.shape[-1:], weight_bias[0], weight_bias[1], eps), total


def no_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    """A NoPE layer's rope (SmolLM3): q and k are left as they are."""


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor | None  # None: no norm before attention (OLMo 2), nor before the MLP
    qkv: Linear | LatentQKV  # q, k, v fused (with their biases, Qwen2); DeepSeek's latent attention
    o: Linear | HeadPrefix
    post_norm: torch.Tensor | None  # the norm before the MLP
    gate_up: Linear | None  # gate and up fused (None for a MoE layer)
    down: Linear | None
    mlp: Callable[[torch.Tensor], torch.Tensor]  # the general forward's MLP (dense or MoE)
    attn: PagedAttention
    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # a RotaryEmbedding, or no_rope
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    chunked: bool = False  # attends within DecoderModel.attention_chunk (Llama 4)


class DecoderModel:
    """``kernel_backend``: "triton" (the default on CUDA) or "cpu" (the default on CPU: the C kernels
    with torch references). Tests run the Triton backend on CPU tensors under the interpreter."""

    # the plain fp32 CPU loop as one C call where it applies (QWORKER_CPU_FUSED_FORWARD=0: never;
    # benchmarks and tests flip it per model for A/B runs)
    fused_cpu_forward = switch("QWORKER_CPU_FUSED_FORWARD")

    def __init__(self, config: PretrainedConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype, max_positions: int,
                 kernel_backend: str | None = None, spec: DecoderSpec | None = None, shard=None):
        """``shard``: a :class:`~qworker.model.parallel.shard.Sharder` (tensor parallelism): the
        layers are sliced to its rank's heads and intermediate range before they are packed."""
        backend = kernel_backend or ("triton" if device.type == "cuda" else "cpu")
        if backend not in ("triton", "cpu"):
            raise ValueError(f"kernel_backend must be 'triton' or 'cpu', got {backend!r}")
        spec = spec or spec_for(config)
        d = dims(config)
        if len(spec.layers) != config.num_hidden_layers:
            raise ValueError(f"config.layer_types has {len(spec.layers)} entries for {config.num_hidden_layers} layers")
        self.config = config
        self.spec = spec
        self.kernel_backend = backend
        self.device = device
        self.dtype = dtype
        self.num_heads = d.num_heads
        self.num_kv_heads = d.num_kv_heads
        self.head_dim = d.head_dim
        self.num_layers = config.num_hidden_layers
        self.eps = spec.norm_eps if spec.norm_eps is not None else config.rms_norm_eps
        self.vocab_size = config.vocab_size
        self.q_size = d.q_size
        self.kv_size = d.kv_size

        # CPU bf16: bf16 weights and GEMMs (oneDNN, fp32 accumulation), fp32 activations between
        # them (norms, rotary, attention and the residual stream in fp32, as the C kernels want)
        self.act_dtype = torch.float32 if device.type == "cpu" and dtype == torch.bfloat16 else dtype
        act = self.act_dtype
        embed = take(weights, "model.embed_tokens.weight", (d.vocab, d.hidden))
        self.embed = embed.to(act)  # the lookup table
        if spec.final_norm is None:  # a LayerNorm without weights
            final_norm = no_affine_norm(d.hidden)
        elif spec.norm == "layer":
            final_norm = take_layer_norm(weights, spec.final_norm, (d.hidden,), spec.final_norm_bias)
        else:
            final_norm = take(weights, f"{spec.final_norm}.weight", (d.hidden,))
        self.norm = self._norm_weight(final_norm)
        tied = getattr(config, "tie_word_embeddings", False)
        stored = weights.get("lm_head.weight")
        if tied and stored is not None and not torch.equal(stored, embed):
            # tied in the config, yet a different head is stored: transformers then unties them and
            # serves the stored head (it says so in a warning), and so does this decoder
            log.warning("tie_word_embeddings is set but lm_head.weight differs from the embedding: serving the stored head, as transformers does")
            tied = False
        if tied:
            weights.pop("lm_head.weight", None)
            lm_head = embed
        else:  # an untied head that is absent would be random in transformers: never the embedding here
            lm_head = take(weights, "lm_head.weight", (d.vocab, d.hidden))
        # an image-text wrapper's head is its own, without a bias whatever the text config says (transformers')
        with_head_bias = spec.head_bias and not getattr(config, "wrapped_by", None)
        head_bias = take(weights, "lm_head.bias", (d.vocab,)).to(act) if with_head_bias else None
        # learned absolute positions (GPT-2): rows past max_position_embeddings are never asked (the
        # runner caps max_model_len there)
        self.position_embeddings = (take(weights, "model.embed_positions.weight",
                                         (config.max_position_embeddings + spec.position_offset, d.hidden)).to(act)
                                    if spec.position_embeddings else None)
        # every layer's tensors are taken (and checked) before any is converted
        raw = [spec.take_layer(weights, i) for i in range(self.num_layers)]
        if spec.parallel_block and (spec.residual_scale is not None or any(r.mlp_out_norm is not None for r in raw)):
            raise ValueError(f"{config.model_type}: a parallel block with a residual scale or an MLP output norm is not supported")
        if shard is not None:  # this rank's heads and MLP slice; the forward reads the sizes below
            raw = [shard.layer(layer) for layer in raw]
            self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
            self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        unused = sorted(n for n in weights if not n.endswith("rotary_emb.inv_freq"))
        if unused:  # e.g. biases the family has no place for: serving without them would be wrong
            more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
            hint = (" (attention biases its config does not give: see attention_bias)"
                    if any(".self_attn." in n and n.endswith("_proj.bias") for n in unused) else "")
            raise ValueError(f"{config.model_type} checkpoint has tensors this family does not use: {', '.join(unused[:3])}{more}{hint}")
        if device.type == "cuda":
            self.linear_backend = "transposed"
        else:
            # a few layers' projections are enough for the start-up timing (and more than the cache)
            sample = [w for layer in raw[:2] for w in self._dense_weights(layer)]
            self.linear_backend = cpu_linear_backend(dtype, sample)
        # a tied head gets its own copy in the GEMM layout; the embedding keeps its rows for lookups
        self.lm_head = Linear(lm_head, head_bias, self.linear_backend, act)
        del embed, lm_head
        # the embedding scale is rounded to the model dtype first, as transformers does
        self.embed_scale = None if spec.embed_scale is None else torch.tensor(spec.embed_scale, dtype=dtype).to(device=device, dtype=act)
        self.final_softcap = spec.final_softcap
        self.logit_divisor = spec.logit_divisor
        self.logit_scale = spec.logit_scale
        self.residual_scale = spec.residual_scale
        self.greedy_head = self._bounded_greedy_head(shard)

        if spec.rope_dim is not None:  # MLA: a table for rope_dim channels, rotating each head's first rope_dim
            self.ropes = {key: PartialRotaryEmbedding(config, spec.rope_dim, max_positions, device, act, backend, layer_type, partial=False)
                          for key, layer_type in spec.rope_tables.items()}
        else:
            self.ropes = {key: rotary_embedding(config, self.head_dim, max_positions, device, act, backend, layer_type, spec.partial_rotary)
                          for key, layer_type in spec.rope_tables.items()}
        scale = spec.attn_scale if spec.attn_scale is not None else self.head_dim**-0.5
        attns: dict[int | None, PagedAttention] = {}
        for a in spec.layers:
            if a.sliding_window not in attns:
                attns[a.sliding_window] = self._attention(backend, scale, a.sliding_window, spec.attn_softcap,
                                                          bf16_products=self.act_dtype != dtype)
        triton = backend == "triton"
        # fused residual-add + RMSNorm: the Triton kernel, or the C kernel on CPU; LayerNorm in torch
        self.norm_fn = layer_norm if spec.norm == "layer" else kernels.rms_norm if triton else kernels.rms_norm_cpu
        self.swiglu = kernels.silu_and_mul if triton else kernels.silu_and_mul_cpu
        activation = {"silu": self.swiglu, "gelu_tanh": gelu_tanh_and_mul, "gelu": gelu_and_mul}.get(spec.activation)

        nope = no_rope if spec.nope_temperature is None else NoPETemperature(*spec.nope_temperature)
        chunks = {a.chunk for a in spec.layers} - {None}
        if len(chunks) > 1 or chunks and any(a.chunk and a.sliding_window for a in spec.layers):
            raise ValueError(f"{config.model_type}: one attention chunk size, without a window, is supported; got {sorted(chunks)}")
        self.attention_chunk: int | None = chunks.pop() if chunks else None
        self.layers = []
        for layer, a in zip(raw, spec.layers):
            gate_up = down = None
            if isinstance(layer.mlp, DenseMLP) and not layer.mlp.gated:  # its own object: no fused loop, no LoRA MLP slots
                m = layer.mlp
                mlp = GatedMLP(Linear(m.gate_up, _cast(m.up_bias, act), self.linear_backend, act),
                               Linear(m.down, _cast(m.down_bias, act), self.linear_backend, act), PLAIN_ACTIVATIONS[spec.activation])
            elif isinstance(layer.mlp, DenseMLP):
                if activation is None:
                    raise ValueError(f"{config.model_type}: a gated MLP with activation {spec.activation!r} is not supported")
                gate_up = Linear(layer.mlp.gate_up, _cast(layer.mlp.up_bias, act), self.linear_backend, act)
                down = Linear(layer.mlp.down, _cast(layer.mlp.down_bias, act), self.linear_backend, act)
                mlp = GatedMLP(gate_up, down, activation)
            else:
                m: MoEWeights = layer.mlp
                mlp = MoE(m.router, m.gate_up, m.down, m.top_k, m.renormalize, self.linear_backend, act, backend,
                          weights_in_act_dtype=m.weights_in_act_dtype, router_bias=m.router_bias, gate_up_bias=m.gate_up_bias,
                          down_bias=m.down_bias, clamped_swiglu=m.clamped_swiglu,
                          routing=Routing(m.scoring, m.choice_bias, m.groups, m.routed_scale, m.renormalize_floor, m.jitter_eps),
                          scale_inputs=m.scale_inputs)
                if m.shared is not None:
                    shared = GatedMLP(Linear(m.shared.gate_up, _cast(m.shared.up_bias, act), self.linear_backend, act),
                                      Linear(m.shared.down, _cast(m.shared.down_bias, act), self.linear_backend, act), activation)
                    mlp = SharedExpertMoE(mlp, shared, None if m.shared_gate is None else m.shared_gate.to(act, copy=True))  # owned: see MoE.router
            opt = self._norm_weight
            self.layers.append(LayerWeights(
                input_norm=opt(layer.input_norm),
                qkv=self._qkv(layer),
                o=self._o(layer),
                post_norm=opt(layer.mlp_norm),
                gate_up=gate_up,
                down=down,
                mlp=mlp,
                # a layer with sinks has an attention object of its own (they are its weights)
                attn=attns[a.sliding_window] if layer.sinks is None else self._attention(
                    backend, scale, a.sliding_window, spec.attn_softcap, bf16_products=self.act_dtype != dtype,
                    sinks=layer.sinks.float().contiguous()),
                rope=self.ropes[a.rope] if a.rotary else nope,
                q_norm=opt(layer.q_norm),
                k_norm=opt(layer.k_norm),
                attn_out_norm=opt(layer.attn_out_norm),
                mlp_out_norm=opt(layer.mlp_out_norm),
                chunked=a.chunk is not None,
            ))
            layer.mlp = None  # the [out, in] originals go as each layer is converted
        raw.clear()
        # the plain loop reads these two; with one window and one rope table they are every layer's
        self.rope = self.layers[0].rope
        self.attn = self.layers[0].attn
        self.fused_layers: DecoderLayers | None = None  # the plain CPU loop in one C call (see _fused)
        fusable = backend == "cpu" and self.linear_backend == "panels" and type(self.rope) is RotaryEmbedding
        if not spec.is_plain() or len(self.ropes) != 1 or not all(map(_plain_layer, self.layers)):
            self.forward = self._forward_general
        elif backend == "cpu" and self.act_dtype != dtype:
            self.norm_bf16 = kernels.rms_norm_bf16_out_cpu
            self.forward = self._forward_cpu_bf16
            if fusable:
                self.fused_layers = self._bind_fused_layers()
        elif fusable and dtype == torch.float32:
            self.fused_layers = self._bind_fused_layers()

    def reach_positions(self, positions: int) -> None:
        """Rope tables covering positions ``[0, positions)``, called before each step (they grow on
        demand: :meth:`RotaryEmbedding.reach`). The one-call C loop is bound again to grown tables
        where it still ran the model as built; where anything had wrapped or replaced what it
        bound (LoRA, tensor parallelism's all-reduce, a benchmark's timers) it is dropped, since
        binding the wrappers would read their plain weights and skip what they add."""
        short = [rope for rope in self.ropes.values() if not rope.covers(positions)]
        if not short:  # every step but a few: nothing to check
            return
        usable = self.fused_layers is not None and self._fused_guard_holds()
        for rope in short:
            rope.reach(positions)
        if self.fused_layers is not None:
            self.fused_layers = self._bind_fused_layers() if usable else None

    def _bounded_greedy_head(self, shard) -> BoundedGreedyHead | None:
        """The LM head's exact shortcut for argmax-only rows (:mod:`kernels.greedy_head`): for fp32
        weights on the CPU packed in panels, a whole (unsharded) model and no logit soft-capping or
        divisor (the tanh, or the division's rounding, can tie logits that differ). It holds a bf16
        copy of the head (half the fp32 head's bytes) and pays where the CPU has bf16 dot products
        (AVX512_BF16 or AMX), so it is
        built there; ``QWORKER_CPU_GREEDY_HEAD=1`` builds it wherever the kernels do (its bf16
        GEMM then runs in fp32 arithmetic: as exact, no faster), ``0`` never."""
        choice = os.environ.get("QWORKER_CPU_GREEDY_HEAD", "auto").strip().lower() or "auto"
        if choice not in ("0", "1", "auto"):
            raise ValueError(f"QWORKER_CPU_GREEDY_HEAD must be 0, 1 or auto, got {choice!r}")
        if (choice == "0" or self.device.type != "cpu" or shard is not None or self.dtype != torch.float32
                or self.linear_backend != "panels" or self.final_softcap is not None or self.logit_divisor is not None
                or self.logit_scale is not None or self.lm_head.bias is not None):
            return None
        supported, _ = bounded_head_supported()
        if not supported and not (choice == "1" and gemm_cpu.gemm_isa(torch.float32) is not None):
            return None
        return BoundedGreedyHead(self.lm_head.weight, self.lm_head.out_features)

    def _head(self, x: torch.Tensor, argmax_rows: torch.Tensor | None) -> torch.Tensor:
        """fp32 logits of the final-normed rows ``x``. ``argmax_rows`` (bool per row, or None): rows
        whose caller wants only the greedy token (:func:`qworker.engine.sampler.argmax_only`). Where
        the bounded head applies, each such row comes back as its token's one-hot log-distribution
        (0 at the greedy token, -inf elsewhere): the argmax of the full row, exactly, without the
        fp32 head's GEMM. Elsewhere every row gets its full logits (the same argmax); when every
        row is argmax-only they stay in the model's dtype (a bf16 model's bf16 logits: the values
        an fp32 copy would hold, without the copy, which is read only for an argmax), or, where a
        bf16 head runs on AMX, only their argmax comes back: the tokens, int64 ``[rows]`` (1-D,
        which :func:`qworker.engine.sampler.sample` takes as the rows' tokens)."""
        all_argmax = argmax_rows is not None and bool(argmax_rows.all())
        if all_argmax:
            tokens = self._greedy_tokens(x)
            if tokens is not None:
                return tokens
        head = self.greedy_head
        if (argmax_rows is None or head is None or type(self.lm_head) is not Linear
                or self.lm_head.weight is not head.exact or not bool(argmax_rows.any())):
            return self._logits(x, keep_dtype=all_argmax)
        out = torch.full((x.shape[0], self.lm_head.out_features), -math.inf)
        rest = torch.nonzero(~argmax_rows).flatten()
        if rest.numel():
            out[rest] = self._logits(x[rest])
        fast = torch.nonzero(argmax_rows).flatten()
        out[fast, head.argmax(x[fast])] = 0.0
        return out

    def _greedy_tokens(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy token (int64 ``[rows]``) straight from a plain bf16 head's GEMM on AMX
        (:func:`kernels.gemm_cpu.argmax_bf16`: the argmax of the bf16 logits ``_logits(x,
        keep_dtype=True)`` returns, without writing them), or None where that does not apply."""
        head = self.lm_head
        if (not self._plain_head() or head.backend != "panels" or head.bias is not None
                or head.weight.dtype != torch.bfloat16):
            return None
        return gemm_cpu.argmax_bf16(x, head.weight, head.out_features)

    def _plain_head(self) -> bool:
        """Whether the logits are the LM head's output as it is: a plain Linear, no divisor, scale
        or soft-cap after it."""
        return (type(self.lm_head) is Linear and self.logit_divisor is None and self.logit_scale is None
                and self.final_softcap is None)

    def _logits(self, x: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """fp32 logits; ``keep_dtype``: the plain head's output in its weight's dtype instead (the
        same values: the GEMM rounds to that dtype either way, see ``Linear.lowp``)."""
        if keep_dtype and self._plain_head():
            return self.lm_head.lowp(x)
        logits = self.lm_head(x)
        if self.logit_divisor is not None:  # before the soft-cap (no family has both)
            logits = logits / self.logit_divisor
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.final_softcap is not None:
            c = self.final_softcap
            logits = torch.tanh(logits / c) * c
        return logits.float()

    def _bind_fused_layers(self) -> DecoderLayers | None:
        """The layers' tensors bound for :class:`kernels.decoder_cpu.DecoderLayers` (None where it
        does not cover the model's shapes), and the guard :meth:`_fused` checks them by."""
        tensors = [dict(input_norm=l.input_norm, post_norm=l.post_norm, qkv=l.qkv.weight, qkv_bias=l.qkv.bias,
                        o=l.o.weight, o_bias=l.o.bias, gate_up=l.gate_up.weight, down=l.down.weight) for l in self.layers]
        bound = DecoderLayers(tensors, self.embed.shape[1], self.num_heads, self.num_kv_heads, self.head_dim,
                              self.layers[0].down.in_features, self.eps, self.attn.scale, self.attn.sliding_window,
                              self.attn.softcap, self.rope.cos, self.rope.sin, self.attn.bf16_products)
        if not bound.ok:
            return None
        # what the C loop reads, as (owner, attribute, object, address): the loop runs only while
        # every attribute still holds that object at that address (a wrapped projection, a replaced
        # norm or bias, or storage swapped under a weight with `.data =` turns it off)
        def entry(owner, name):
            obj = getattr(owner, name)
            return owner, name, obj, obj.data_ptr() if isinstance(obj, torch.Tensor) else None

        guard = [entry(self, "rope"), entry(self, "attn"), entry(self.rope, "cos"), entry(self.rope, "sin")]
        for l in self.layers:
            guard += [entry(l, "input_norm"), entry(l, "post_norm")]
            for name in ("qkv", "o", "gate_up", "down"):
                guard += [entry(l, name), entry(getattr(l, name), "weight"), entry(getattr(l, name), "bias")]
        owners, names, objs, _ = zip(*guard)
        tensors = [obj for *_, obj, ptr in guard if ptr is not None]
        self._fused_guard = (owners, names, objs, tensors, [ptr for *_, ptr in guard if ptr is not None])
        return bound

    def _qkv(self, layer: RawLayer) -> Linear | LatentQKV:
        if not isinstance(layer.qkv, LatentAttentionWeights):
            return Linear(layer.qkv, layer.qkv_bias, self.linear_backend, self.act_dtype)
        m = layer.qkv

        def linear(w, b=None):
            return Linear(w, b, self.linear_backend, self.act_dtype)
        return LatentQKV(None if m.q_a is None else linear(m.q_a, m.q_a_bias), self._norm_weight(m.q_a_norm), linear(m.q_b),
                         linear(m.kv_a, m.kv_a_bias), self._norm_weight(m.kv_a_norm), linear(m.kv_b), self.num_heads,
                         self.head_dim, m.rope, m.nope, m.v_dim, self.norm_fn, m.norm_eps)

    def _o(self, layer: RawLayer) -> Linear | HeadPrefix:
        o = Linear(layer.o, layer.o_bias, self.linear_backend, self.act_dtype)
        if isinstance(layer.qkv, LatentAttentionWeights) and layer.qkv.v_dim != self.head_dim:
            return HeadPrefix(o, self.num_heads, self.head_dim, layer.qkv.v_dim)
        return o

    def _norm_weight(self, w: torch.Tensor | None) -> torch.Tensor | None:
        if w is None:
            return None
        if self.spec.norm_plus_one and self.spec.norm == "layer":  # Nemotron: (1 + w), the bias as it is
            w = torch.stack([w[0] + 1.0, w[1]])
        elif self.spec.norm_plus_one:  # Gemma's (1 + w), added in fp32 as its RMSNorm does
            w = w.float() + 1.0
        return w.to(device=self.device, dtype=self.act_dtype)  # a norm a family builds (OLMo's) starts on the CPU

    @staticmethod
    def _dense_weights(layer: RawLayer) -> list[torch.Tensor]:
        mlp = [layer.mlp.gate_up, layer.mlp.down] if isinstance(layer.mlp, DenseMLP) else []
        qkv = [layer.qkv.q_b, layer.qkv.kv_b] if isinstance(layer.qkv, LatentAttentionWeights) else [layer.qkv]
        return [*qkv, layer.o, *mlp]

    @staticmethod
    def _attention(backend: str, scale: float, window: int | None, softcap: float | None,
                   bf16_products: bool = False, sinks: torch.Tensor | None = None) -> PagedAttention:
        return PagedAttention(backend, scale=scale, sliding_window=window, softcap=softcap, bf16_products=bf16_products, sinks=sinks)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # rows whose next-token logits are wanted
        argmax_rows: torch.Tensor | None = None,  # of those, the argmax-only ones (see _head)
    ) -> torch.Tensor:
        norm = self.norm_fn
        h = F.embedding(input_ids, self.embed)
        T = h.shape[0]
        fused = self._fused(h, positions, kv_caches, meta) if self.fused_layers is not None else None
        if fused is not None:
            h, residual = fused
        else:
            residual = None  # the running sum of the residual stream; h is the latest branch output
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x, residual = norm(h, layer.input_norm, self.eps, residual)
                qkv = layer.qkv(x)
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                q = q.view(T, self.num_heads, self.head_dim)
                k = k.view(T, self.num_kv_heads, self.head_dim)
                v = v.reshape(T, self.num_kv_heads, self.head_dim)
                self.rope(positions, q, k)  # in place, in the qkv buffer
                attn = self.attn(q, k, v, k_cache, v_cache, meta)
                h = layer.o(attn.reshape(T, self.q_size))
                x, residual = norm(h, layer.post_norm, self.eps, residual)
                h = layer.down(self.swiglu(layer.gate_up(x)))
        x, _ = norm(h[logits_indices], self.norm, self.eps, residual[logits_indices])
        return self._head(x, argmax_rows)

    def _fused(self, h, positions, kv_caches, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The caller's layer loop (:meth:`forward`'s, or :meth:`_forward_cpu_bf16`'s for bf16
        weights) in one C call (:mod:`kernels.decoder_cpu`, bit for bit the same kernels), or None:
        turned off (``fused_cpu_forward``), a projection wrapped or replaced
        since the model was built (LoRA, tensor parallelism, a benchmark's timers), any tensor it
        bound replaced or moved (see ``_fused_guard``), or inputs it does not cover."""
        if not self.fused_cpu_forward or not self._fused_guard_holds():
            return None
        return self.fused_layers.run(h, positions, kv_caches, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, meta.num_decodes)

    def _fused_guard_holds(self) -> bool:
        """Every object and tensor the C loop bound is still where it was (see ``_fused_guard``)."""
        owners, names, objs, tensors, ptrs = self._fused_guard
        # map() over the ~400 entries: a generator here cost ~0.5 ms a step (1% of a bf16 run)
        return all(map(operator.is_, map(getattr, owners, names), objs)) and list(map(torch.Tensor.data_ptr, tensors)) == ptrs

    @torch.inference_mode()
    def _forward_cpu_bf16(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        argmax_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` for the CPU bf16 mode without the fp32 copies of the GEMMs' bf16 inputs
        and outputs: the norms write the qkv, gate_up and LM-head inputs in bf16, and o's, gate_up's
        and down's bf16 outputs go as they are to the C kernels that read them (the next norm, the
        SwiGLU). Same values as :meth:`forward` (a GEMM rounds its output to bf16 anyway, and the
        kernels round their outputs once, as the conversion did); the residual stream, rope and
        attention stay fp32. Projections wrapped by LoRA or tensor parallelism take :meth:`forward`."""
        if not self._plain_projections():
            return DecoderModel.forward(self, input_ids, positions, kv_caches, meta, logits_indices, argmax_rows)
        norm = self.norm_bf16
        h = F.embedding(input_ids, self.embed)
        T = h.shape[0]
        fused = self._fused(h, positions, kv_caches, meta) if self.fused_layers is not None else None
        if fused is not None:
            h, residual = fused
        else:
            residual = None
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x, residual = norm(h, layer.input_norm, self.eps, residual)
                qkv = layer.qkv(x)  # fp32: rope and attention read it
                q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
                q = q.view(T, self.num_heads, self.head_dim)
                k = k.view(T, self.num_kv_heads, self.head_dim)
                v = v.reshape(T, self.num_kv_heads, self.head_dim)
                self.rope(positions, q, k)
                attn = self.attn(q, k, v, k_cache, v_cache, meta)
                h = layer.o.lowp(attn.reshape(T, self.q_size))
                x, residual = norm(h, layer.post_norm, self.eps, residual)
                h = layer.down.lowp(self.swiglu(layer.gate_up.lowp(x)))
        x, _ = norm(h[logits_indices], self.norm, self.eps, residual[logits_indices])
        return self._head(x, argmax_rows)

    def _plain_projections(self) -> bool:
        if type(self.lm_head) is not Linear:
            return False
        return all(type(p) is Linear for layer in self.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down))

    @torch.inference_mode()
    def _forward_general(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        argmax_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` with every family hook (see :class:`DecoderSpec`)."""
        norm, eps = self.norm_fn, self.eps
        qk_norm, clip, scale, parallel = self.spec.qk_norm, self.spec.clip_qkv, self.residual_scale, self.spec.parallel_block
        h = F.embedding(input_ids, self.embed)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if self.position_embeddings is not None:  # OPT's rows start at an offset
            h = h + F.embedding(positions + self.spec.position_offset, self.position_embeddings)
        T = h.shape[0]
        # the chunked layers' view of the step (once a step; the cache is [blocks, block_size, ...])
        local = chunked_metadata(meta, self.attention_chunk, kv_caches[0][0].shape[1]) if self.attention_chunk else None
        residual = None  # the running sum of the residual stream; h is the latest branch output
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            x, residual = self._add_norm(h, layer.input_norm, residual)
            qkv = layer.qkv(x)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if qk_norm == "full":  # over q's and k's whole width, before the head split
                q.copy_(norm(q, layer.q_norm, eps)[0])
                k.copy_(norm(k, layer.k_norm, eps)[0])
            if clip is not None:
                qkv.clamp_(-clip, clip)
            q = q.view(T, self.num_heads, self.head_dim)
            k = k.view(T, self.num_kv_heads, self.head_dim)
            v = v.reshape(T, self.num_kv_heads, self.head_dim)
            if qk_norm == "head" and layer.q_norm is not None:  # written back into the qkv buffer, where the rope kernel wants them
                q.copy_(norm(q, layer.q_norm, eps)[0])
                k.copy_(norm(k, layer.k_norm, eps)[0])
            elif qk_norm == "head_layer":  # each head its own weight and bias; fp32 throughout, rounded once
                for t, w in ((q, layer.q_norm), (k, layer.k_norm)):
                    t.copy_(F.layer_norm(t.float(), t.shape[-1:], eps=eps) * w[0].float() + w[1].float())
            layer.rope(positions, q, k)
            if qk_norm == "head_after_rope":  # Hunyuan norms the rotated q and k
                q.copy_(norm(q, layer.q_norm, eps)[0])
                k.copy_(norm(k, layer.k_norm, eps)[0])
            attn = layer.attn(q, k, v, k_cache, v_cache, local if layer.chunked else meta)
            h = layer.o(attn.reshape(T, self.q_size))
            if layer.attn_out_norm is not None:
                h = norm(h, layer.attn_out_norm, eps)[0]
            if scale is not None:
                h = h * scale
            if parallel:  # the MLP reads the layer's input: normed as attention read it, or by its own norm
                mlp_out = layer.mlp(x if layer.post_norm is None else norm(residual, layer.post_norm, eps)[0])
                if self.spec.parallel_attention_first:  # (residual + attn) + mlp, as Cohere and StableLM add them
                    residual, h = residual + h, mlp_out
                else:  # (attn + mlp) + residual, as Phi, GPT-J and GPT-NeoX do
                    h = h + mlp_out
                continue
            x, residual = self._add_norm(h, layer.post_norm, residual)
            h = layer.mlp(x)
            if layer.mlp_out_norm is not None:
                h = norm(h, layer.mlp_out_norm, eps)[0]
            if scale is not None:
                h = h * scale
        x, _ = norm(h[logits_indices], self.norm, eps, residual[logits_indices])
        return self._head(x, argmax_rows)


    def _add_norm(self, h: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + h), residual + h)``, the fused kernel's pair; without a norm weight
        (OLMo 2) the branch reads the sum itself: ``(residual + h, residual + h)``."""
        if weight is not None:
            return self.norm_fn(h, weight, self.eps, residual)
        total = h if residual is None else residual + h
        return total, total


def _cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype)


def _plain_layer(layer: LayerWeights) -> bool:
    """The Llama loop runs the layer as it is: Llama's two norms, a dense MLP, nothing more."""
    return (type(layer.qkv) is Linear and type(layer.o) is Linear
            and layer.gate_up is not None and layer.input_norm is not None and layer.post_norm is not None
            and layer.gate_up.bias is None and layer.down.bias is None and layer.attn.sinks is None
            and layer.q_norm is None and layer.k_norm is None and layer.attn_out_norm is None and layer.mlp_out_norm is None)


# the name the runner and benches knew it by
LlamaModel = DecoderModel
