"""What one decoder family is, as data: how to read a layer's tensors and what its forward adds
to the shared skeleton (norm -> attention -> norm -> MLP, :mod:`qworker.model.decoder`).

A family module builds a :class:`DecoderSpec` from a transformers config. The weight readers here
check every tensor's presence and shape, so a broken checkpoint is one ``ValueError`` line naming
the tensor, raised before any weight is converted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import PretrainedConfig

from qworker.model.rope import rope_parameters

Weights = dict[str, torch.Tensor]


@dataclass(slots=True)
class Dims:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


# families whose attention has no num_key_value_heads: a k and v head per query head (GPT-BigCode:
# one for all under multi_query), whatever stray key a config.json carries
_ONE_KV_PER_HEAD = ("gpt2", "gpt_bigcode", "gpt_neox", "gptj", "opt")


def dims(config: PretrainedConfig) -> Dims:
    """The attention's sizes as the decoder and its KV cache hold them. Under latent attention
    (:func:`latent_attention`: DeepSeek's MLA) every query head has its own k and v head, as wide
    as the wider of q/k (the rotated channels, then the others) and v (the other padded)."""
    heads = config.num_attention_heads
    if latent_attention(config):
        return Dims(hidden=config.hidden_size, num_heads=heads, num_kv_heads=heads,
                    head_dim=max(config.qk_rope_head_dim + config.qk_nope_head_dim, config.v_head_dim), vocab=config.vocab_size)
    if config.model_type in _ONE_KV_PER_HEAD:
        kv_heads = 1 if getattr(config, "multi_query", False) else heads
    elif config.model_type == "falcon":  # KV groups in the new architecture, else multi-query or one per head
        new_arch = getattr(config, "new_decoder_architecture", False)
        kv_heads = config.num_kv_heads if new_arch else 1 if getattr(config, "multi_query", True) else heads
    else:
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return Dims(
        hidden=config.hidden_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab=config.vocab_size,
    )


def latent_attention(config: PretrainedConfig) -> bool:
    """Whether the family's attention is DeepSeek's multi-head latent attention (MLA)."""
    return getattr(config, "kv_lora_rank", None) is not None and hasattr(config, "qk_nope_head_dim")


@dataclass(slots=True)
class DenseMLP:
    """A dense MLP's weights, ``[out, in]``. Gated (the default): ``gate_up`` holds the gate rows,
    then the up rows, and the MLP is ``down(act(gate x) * up x)``. Not gated (StarCoder 2, Phi):
    ``gate_up`` is the up projection alone and the MLP is ``down(act(up x))``. Biases optional."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gated: bool = True
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


@dataclass(slots=True)
class MoEWeights:
    """A sparse MoE block: router ``[E, H]``, experts' ``[E, 2I, H]`` (gate rows, then up) and
    ``[E, H, I]``; routing options as :class:`qworker.model.moe.MoE` takes them."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    top_k: int
    renormalize: bool
    weights_in_act_dtype: bool
    # gpt-oss: biases on the router ([E]) and the experts ([E, 2I], [E, H]), and the clamped SwiGLU (alpha, limit)
    router_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    clamped_swiglu: tuple[float, float] | None = None
    # Qwen2-MoE: an expert every token takes, weighted by sigmoid(x @ shared_gate.T) (shared_gate [1, H]);
    # GraniteMoE-Shared: the same without a gate (shared_gate None)
    shared: DenseMLP | None = None
    shared_gate: torch.Tensor | None = None
    # DeepSeek-V2/V3, GLM-4.5: how the router scores and picks (see qworker.model.moe.Routing)
    scoring: str = "softmax"  # or "sigmoid"
    choice_bias: torch.Tensor | None = None  # [E]: added to the scores to pick experts, not to weigh them
    groups: tuple[int, int, str] | None = None  # (groups, groups kept, "max" | "top2": a group's score)
    routed_scale: float = 1.0  # the routed experts' weights times this
    renormalize_floor: float = 0.0  # ERNIE 4.5: renormalised weights divide by max(sum, this) (moe_norm_min)
    jitter_eps: float = 0.0  # Phi-3.5-MoE's SparseMixer: the logit band each pick's softmax keeps (scoring "sparsemixer")
    scale_inputs: bool = False  # Llama 4: expert(x * weight) instead of expert(x) * weight


@dataclass(slots=True)
class LatentAttentionWeights:
    """DeepSeek's multi-head latent attention (MLA), ``[out, in]``. q is ``q_b(norm(q_a(x)))``, or
    ``q_b(x)`` without ``q_a`` (V2-Lite's ``q_proj``); ``kv_a(x)`` gives the latent (normed, then
    ``kv_b`` makes each head's k channels without rotation and its v) and one rotated k part all
    heads share. Rows are reordered at load so that each head's q starts with its rotated channels
    (:func:`qworker.model.families.deepseek.build`), the order the decoder's k takes too."""

    q_a: torch.Tensor | None
    q_a_bias: torch.Tensor | None
    q_a_norm: torch.Tensor | None
    q_b: torch.Tensor  # [heads * (rope + nope), q_lora_rank or hidden]
    kv_a: torch.Tensor  # [kv_lora_rank + rope, hidden]
    kv_a_bias: torch.Tensor | None
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: torch.Tensor  # [heads * (nope + v), kv_lora_rank]: per head its k channels, then its v
    rope: int
    nope: int
    v_dim: int
    norm_eps: float  # the latent norms' (transformers builds them with RMSNorm's default, not rms_norm_eps)


@dataclass(slots=True)
class RawLayer:
    """One layer's tensors as the checkpoint has them (``[out, in]``), projections fused. Under
    LayerNorm (``DecoderSpec.norm == "layer"``) each norm is ``[2, H]``: its weight, then its bias
    (zeros where the checkpoint has none; :func:`take_layer_norm`)."""

    input_norm: torch.Tensor | None  # None: the branch reads the residual stream as it is (OLMo 2)
    qkv: torch.Tensor | LatentAttentionWeights  # q, k, v fused; or DeepSeek's latent attention
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    # the norm before the MLP (Llama's post_attention_layernorm); None as input_norm, or in a
    # parallel block (DecoderSpec.parallel_block) the MLP reads the attention's normed input
    mlp_norm: torch.Tensor | None
    mlp: DenseMLP | MoEWeights
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # gpt-oss: [heads], one more logit per query head in its softmax
    attn_out_norm: torch.Tensor | None = None  # Gemma, OLMo 2: on the attention output, before the residual add
    mlp_out_norm: torch.Tensor | None = None  # Gemma, OLMo 2: on the MLP output, before the residual add


@dataclass(slots=True)
class LayerAttention:
    """A layer's attention options (``sliding_window``: the query at ``p`` sees ``p - W < j <= p``)
    and which rope table it uses (a key into :attr:`DecoderSpec.rope_tables`; ``rotary=False``:
    none, the layer's q and k are not rotated: SmolLM3's NoPE layers)."""

    sliding_window: int | None = None
    rope: str | None = None
    rotary: bool = True
    # local attention in chunks: the query at p sees keys from floor(p / chunk) * chunk on (Llama 4)
    chunk: int | None = None


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_LORA = LORA_MODULES[:4]


@dataclass
class DecoderSpec:
    """Everything a family changes in the shared decoder. The defaults are Llama."""

    take_layer: Callable[[Weights, int], RawLayer]
    layers: list[LayerAttention]
    norm_plus_one: bool = False  # Gemma's RMSNorm (Nemotron's LayerNorm) multiplies by (1 + w): folded into w at load
    # "head": RMSNorm over head_dim per head (Qwen3, Gemma 3); "head_after_rope": the same on the
    # rotated q and k (Hunyuan); "full": over q/k's width (OLMoE);
    # "head_layer": LayerNorm over head_dim with a weight and bias per head ([2, heads, head_dim]: Cohere, StableLM)
    qk_norm: str | None = None
    clip_qkv: float | None = None  # OLMoE: q, k (after their norms) and v clamped to [-c, c]
    activation: str = "silu"  # the MLP's activation: "silu", "gelu_tanh", "gelu" (erf), "relu2" (relu(x) ** 2), "relu" (the last two non-gated only)
    norm: str = "rms"  # "layer": LayerNorm (mean-centred; weights as RawLayer says)
    norm_eps: float | None = None  # default config.rms_norm_eps
    # attention and MLP both read the layer's input (normed) and add to the residual together
    # (Phi, Cohere, StableLM with use_parallel_residual, GPT-J, GPT-NeoX); RawLayer.mlp_norm None:
    # the same normed input. Not combined with residual_scale or mlp_out_norm (no family has both).
    parallel_block: bool = False
    parallel_attention_first: bool = False  # its sum as (residual + attn) + mlp (Cohere, StableLM), else (attn + mlp) + residual
    # the final norm's tensor prefix (Phi: model.final_layernorm); None: a LayerNorm without weights (OLMo)
    final_norm: str | None = "model.norm"
    final_norm_bias: bool = False  # under LayerNorm: whether the final norm has a bias
    head_bias: bool = False  # Phi: lm_head.bias
    logit_scale: float | None = None  # Cohere: logits times this
    # GPT-2, GPT-BigCode: learned absolute positions (model.embed_positions.weight) added to the
    # embeddings; their layers take no rotary embeddings (LayerAttention.rotary False)
    position_embeddings: bool = False
    position_offset: int = 0  # OPT: position p reads row p + 2
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden), rounded to the model dtype; Granite's multiplier
    attn_scale: float | None = None  # default head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    residual_scale: float | None = None  # Granite: each branch's output times this before the residual add
    logit_divisor: float | None = None  # Granite: logits divided by this (``logits_scaling``)
    # rope table key -> the layer type to read from config.rope_parameters (None: the flat dict)
    rope_tables: dict[str | None, str | None] = field(default_factory=lambda: {None: None})
    # rotate only config.partial_rotary_factor of each head (Phi-3); transformers' other families
    # rotate the whole head whatever that key says, and so does this decoder for them
    partial_rotary: bool = False
    # GLM: each head's q and k output rows reordered at load (take_layer applies it, and the LoRA
    # reader to q_proj's and k_proj's B): see rotate_halves_not_pairs
    qk_rows: Callable[[torch.Tensor], torch.Tensor] | None = None
    # the PEFT module names LoRA adapts in this family: those it has by these names, as separate
    # projections the decoder can wrap (Phi-3's fused qkv_proj has no q_proj; Phi's o is "dense")
    lora_modules: tuple[str, ...] = LORA_MODULES
    # Llama 4: NoPE layers scale q by position, (floor_scale, attn_scale) (qworker.model.rope.NoPETemperature)
    nope_temperature: tuple[float, float] | None = None
    # DeepSeek's MLA: a rope table for a head of this many channels, rotating each head's first
    # that many (the head itself is wider: dims())
    rope_dim: int | None = None

    def is_plain(self) -> bool:
        """The Llama forward suffices: nothing beyond one window for every layer."""
        first = self.layers[0]
        return (not self.norm_plus_one and self.qk_norm is None and self.clip_qkv is None and self.activation == "silu"
                and self.embed_scale is None and self.attn_softcap is None and self.final_softcap is None
                and self.residual_scale is None and self.norm == "rms" and not self.parallel_block and not self.head_bias
                and self.logit_scale is None and not self.position_embeddings and first.rotary and first.chunk is None and self.rope_dim is None
                and self.nope_temperature is None
                and all(a == first for a in self.layers))


def take(w: Weights, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Pops ``name`` from the checkpoint, checking its shape, type and values: one clear line if it
    is absent, has another shape, is not stored as real numbers (``loader.load_state_dict`` casts
    only those) or holds a NaN or an infinity (a model that would answer every job with token 0)."""
    t = w.pop(name, None)
    if t is None:
        raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    if not t.is_floating_point() or t.dtype.itemsize < 2:
        raise ValueError(f"tensor {name!r} is stored as {t.dtype}, not as floating-point weights "
                         "(quantized checkpoints are not supported)")
    if not _finite(t):
        raise ValueError(f"tensor {name!r} holds NaN or infinite values (as {t.dtype})")
    return t


def _finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """Every value finite, checked a slice at a time (no mask the size of an embedding table)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


# (q/k/v biases, o bias) of the families whose transformers model fixes them
_FIXED_BIASES = {"qwen2": (True, False), "qwen2_vl_text": (True, False), "qwen2_5_vl_text": (True, False),
                 "mistral": (False, False), "ministral": (False, False), "mixtral": (False, False), "exaone4": (False, False),
                 "cwm": (False, False), "minimax_m2": (False, False)}
_NO_O_BIAS = ("qwen2_moe", "glm", "glm4", "glm4_moe", "helium")  # q/k/v biases as the config says, o never
# q/k/v biases as attention_bias says (True by default), o's as attention_out_bias does
_SEPARATE_O_BIAS = ("seed_oss",)


def attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
    """``(q/k/v biases, o bias)`` as transformers builds the family's projections: Qwen2's q/k/v
    always and o never, Qwen2-MoE's q/k/v as ``qkv_bias`` says and GLM's as ``attention_bias``
    says (o never), none for Mistral, Ministral,
    Mixtral and EXAONE 4; elsewhere (Llama, Qwen3, OLMo, Gemma, Granite, SmolLM3) Llama's rule,
    ``attention_bias`` for all four."""
    if config.model_type in _NO_O_BIAS:
        return bool(getattr(config, "qkv_bias" if config.model_type == "qwen2_moe" else "attention_bias", True)), False
    if config.model_type in _SEPARATE_O_BIAS:
        return bool(getattr(config, "attention_bias", True)), bool(getattr(config, "attention_out_bias", False))
    if config.model_type in _FIXED_BIASES:
        return _FIXED_BIASES[config.model_type]
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def take_attention(w: Weights, p: str, d: Dims, biases: tuple[bool, bool]) -> dict:
    """q/k/v/o as separate projections (``self_attn.{q,k,v,o}_proj``), q/k/v fused. ``biases``:
    whether the family's config gives q/k/v and o biases, as transformers builds the projections
    (:func:`attention_biases`). A bias the config gives must be in the checkpoint; one it does not
    give is left in the checkpoint, which the decoder then refuses as a tensor it does not use
    (transformers would drop it and serve another model than the checkpoint's author trained)."""
    qkv_bias, o_bias = biases
    sizes = (d.q_size, d.kv_size, d.kv_size)
    mats = [take(w, f"{p}self_attn.{n}_proj.weight", (s, d.hidden)) for n, s in zip("qkv", sizes)]
    return {
        "qkv": torch.cat(mats),
        "qkv_bias": torch.cat([take(w, f"{p}self_attn.{n}_proj.bias", (s,)) for n, s in zip("qkv", sizes)]) if qkv_bias else None,
        "o": take(w, f"{p}self_attn.o_proj.weight", (d.hidden, d.q_size)),
        "o_bias": take(w, f"{p}self_attn.o_proj.bias", (d.hidden,)) if o_bias else None,
    }


def take_dense_mlp(w: Weights, p: str, hidden: int, intermediate: int, bias: bool = False) -> DenseMLP:
    """``{p}{gate,up,down}_proj`` (and their biases where ``bias``: :func:`mlp_bias`)."""
    gate = take(w, f"{p}gate_proj.weight", (intermediate, hidden))
    up = take(w, f"{p}up_proj.weight", (intermediate, hidden))
    mlp = DenseMLP(torch.cat([gate, up]), take(w, f"{p}down_proj.weight", (hidden, intermediate)))
    if bias:
        mlp.up_bias = torch.cat([take(w, f"{p}gate_proj.bias", (intermediate,)), take(w, f"{p}up_proj.bias", (intermediate,))])
        mlp.down_bias = take(w, f"{p}down_proj.bias", (hidden,))
    return mlp


def take_plain_mlp(w: Weights, up: str, down: str, hidden: int, intermediate: int, bias: bool) -> DenseMLP:
    """A non-gated MLP ``down(act(up(x)))``: the ``{up}``/``{down}`` weights (``[out, in]``) and,
    where ``bias``, their biases."""
    return DenseMLP(take(w, f"{up}.weight", (intermediate, hidden)), take(w, f"{down}.weight", (hidden, intermediate)), gated=False,
                    up_bias=take(w, f"{up}.bias", (intermediate,)) if bias else None,
                    down_bias=take(w, f"{down}.bias", (hidden,)) if bias else None)


def checkpoint_names(prefixes: tuple[tuple[str, str], ...], mask_buffers: tuple[str, ...]) -> Callable[[str], str | None]:
    """A family's ``checkpoint_name`` for checkpoints named otherwise (GPT-2, GPT-J, GPT-NeoX):
    ``prefixes`` renamed; the causal-mask buffers older exports carry (names ending in one of
    ``mask_buffers``, such as ``attn.bias`` and ``attn.masked_bias``) not read (None), as
    transformers drops them."""
    def checkpoint_name(name: str) -> str | None:
        return None if name.endswith(mask_buffers) else renamed(name, prefixes)
    return checkpoint_name


# whose transformers MLP reads mlp_bias
_MLP_BIAS_FAMILIES = ("llama", "granite", "smollm3", "seed_oss", "arcee", "nemotron", "helium", "cwm")


def mlp_bias(config: PretrainedConfig) -> bool:
    """Whether the family's MLP projections have biases: ``mlp_bias`` where transformers reads it
    (elsewhere a stored MLP bias is refused as a tensor the family does not use)."""
    return config.model_type in _MLP_BIAS_FAMILIES and bool(getattr(config, "mlp_bias", False))


def take_experts(w: Weights, p: str, num_experts: int, hidden: int, intermediate: int, names=("gate_proj", "up_proj", "down_proj")) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert ``{p}{e}.{gate,up,down}`` -> stacked ``[E, 2I, H]`` and ``[E, H, I]``. A checkpoint
    in transformers 5's fused layout (``save_pretrained(save_original_format=False)``) holds them
    stacked already, gate rows before up rows: ``{p}gate_up_proj`` and ``{p}down_proj``."""
    if f"{p}gate_up_proj" in w:
        return (take(w, f"{p}gate_up_proj", (num_experts, 2 * intermediate, hidden)),
                take(w, f"{p}down_proj", (num_experts, hidden, intermediate)))
    g, u, dn = names
    gate_up = torch.stack([
        torch.cat([take(w, f"{p}{e}.{g}.weight", (intermediate, hidden)), take(w, f"{p}{e}.{u}.weight", (intermediate, hidden))])
        for e in range(num_experts)
    ])
    down = torch.stack([take(w, f"{p}{e}.{dn}.weight", (hidden, intermediate)) for e in range(num_experts)])
    return gate_up, down


def llama_layer(w: Weights, i: int, d: Dims, intermediate: int, mlp: Callable[[Weights, str], DenseMLP | MoEWeights] | None = None,
                *, biases: tuple[bool, bool], norms: bool = True, mlp_bias: bool = False) -> RawLayer:
    """The Llama layout: ``input_layernorm``, ``self_attn.*``, ``post_attention_layernorm``, ``mlp.*``
    (``norms=False``: the norms left to the caller, which takes them another way)."""
    p = f"model.layers.{i}."
    attn = take_attention(w, p, d, biases)
    return RawLayer(
        input_norm=take(w, f"{p}input_layernorm.weight", (d.hidden,)) if norms else None,
        mlp_norm=take(w, f"{p}post_attention_layernorm.weight", (d.hidden,)) if norms else None,
        mlp=mlp(w, p) if mlp else take_dense_mlp(w, f"{p}mlp.", d.hidden, intermediate, mlp_bias),
        **attn,
    )


def take_full_qk_norms(w: Weights, i: int, d: Dims, layer: RawLayer) -> RawLayer:
    """Layer ``i``'s RMSNorms over q's and k's full width (``self_attn.q_norm``/``k_norm``: OLMoE,
    MiniMax-M2; DecoderSpec.qk_norm "full"), set on ``layer``."""
    p = f"model.layers.{i}.self_attn."
    layer.q_norm = take(w, f"{p}q_norm.weight", (d.q_size,))
    layer.k_norm = take(w, f"{p}k_norm.weight", (d.kv_size,))
    return layer


def post_norm_layer(w: Weights, i: int, d: Dims, intermediate: int, qk_norm: str, biases: tuple[bool, bool],
                    mlp: Callable[[Weights, str], DenseMLP | MoEWeights] | None = None) -> RawLayer:
    """OLMo 2's layout (EXAONE 4's and FlexOlmo's too): no norm before attention or the MLP; each
    branch's output normed (``post_attention_layernorm``, ``post_feedforward_layernorm``) before
    its residual add; q and k normed over their full width (``qk_norm`` "full") or over each head
    ("head"). ``mlp``: reads the layer's MLP another way (FlexOlmo's MoE)."""
    p = f"model.layers.{i}."
    q_width, k_width = (d.q_size, d.kv_size) if qk_norm == "full" else (d.head_dim, d.head_dim)
    return RawLayer(
        input_norm=None,
        mlp_norm=None,
        attn_out_norm=take(w, f"{p}post_attention_layernorm.weight", (d.hidden,)),
        mlp_out_norm=take(w, f"{p}post_feedforward_layernorm.weight", (d.hidden,)),
        q_norm=take(w, f"{p}self_attn.q_norm.weight", (q_width,)),
        k_norm=take(w, f"{p}self_attn.k_norm.weight", (k_width,)),
        mlp=mlp(w, p) if mlp else take_dense_mlp(w, f"{p}mlp.", d.hidden, intermediate),
        **take_attention(w, p, d, biases),
    )


# transformers' activation names -> DecoderSpec.activation ("gelu_tanh": 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))))
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu": "gelu", "relu2": "relu2", "relu": "relu"}


def activation(config: PretrainedConfig, field_name: str = "hidden_act") -> str:
    """``config.hidden_act`` (or another field) as :attr:`DecoderSpec.activation`, or a one-line refusal."""
    name = getattr(config, field_name, None) or "silu"
    if name not in ACTIVATIONS:
        raise ValueError(f"{config.model_type}: unsupported {field_name} {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


def take_layer_norm(w: Weights, prefix: str, shape: tuple[int, ...], bias: bool) -> torch.Tensor:
    """A LayerNorm's ``{prefix}.weight`` (and ``{prefix}.bias`` where ``bias``) of ``shape``,
    stacked ``[2, *shape]``: weight, then bias (zeros without one), as RawLayer holds norms under
    LayerNorm."""
    weight = take(w, f"{prefix}.weight", shape)
    return torch.stack([weight, take(w, f"{prefix}.bias", shape) if bias else torch.zeros_like(weight)])


def per_head_layer_norms(w: Weights, prefix: str, heads: int, head_dim: int) -> torch.Tensor:
    """StableLM's per-head q/k LayerNorms (``{prefix}.norms.{h}.weight``, no bias) as one
    ``[2, heads, head_dim]`` (see DecoderSpec.qk_norm "head_layer")."""
    weight = torch.stack([take(w, f"{prefix}.norms.{h}.weight", (head_dim,)) for h in range(heads)])
    return torch.stack([weight, torch.zeros_like(weight)])


def uniform_layers(config: PretrainedConfig, window: int | None) -> list[LayerAttention]:
    return [LayerAttention(sliding_window=window) for _ in range(config.num_hidden_layers)]


def typed_layers(config: PretrainedConfig) -> list[LayerAttention]:
    """Per-layer windows from ``config.layer_types``: ``config.sliding_window`` where a layer is
    "sliding_attention", full attention elsewhere (transformers' eager attention masks by
    ``layer_types`` alone). A layer marked sliding in a config without a window is refused
    (transformers fails on it too)."""
    types = layer_types(config)
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in types and not window:
        raise ValueError(f"{config.model_type}: config.layer_types marks layer {types.index('sliding_attention')} sliding, "
                         f"but sliding_window is {window!r}")
    return [LayerAttention(sliding_window=window if t == "sliding_attention" else None) for t in types]


LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_types(config: PretrainedConfig, known: tuple[str, ...] = LAYER_TYPES) -> list[str]:
    """``config.layer_types`` (every layer full where it has none), checked: one entry per layer,
    each a type this engine serves (``known``: the family's)."""
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
    if len(types) != n:
        raise ValueError(f"{config.model_type}: config.layer_types has {len(types)} entries for {n} layers")
    unknown = sorted(set(types) - set(known))
    if unknown:
        raise ValueError(f"{config.model_type}: unsupported layer type {unknown[0]!r} in config.layer_types; supported: {', '.join(known)}")
    return types


def ropes_by_layer_type(config: PretrainedConfig, layers: list[LayerAttention]) -> tuple[dict, list[LayerAttention]]:
    """``(rope_tables, layers)`` for a config whose ``rope_parameters`` hold one dict per layer type
    (Gemma 3, OLMo 3): one table per type, each layer naming its own; else the one flat table."""
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params.get("full_attention"), dict):
        return {None: None}, layers
    types = layer_types(config)
    missing = sorted(t for t in set(types) if not isinstance(params.get(t), dict))
    if missing:
        raise ValueError(f"{config.model_type}: config.rope_parameters has no entry for layer type {missing[0]!r}")
    tables = {t: t for t in sorted(set(types))}
    return tables, [LayerAttention(sliding_window=a.sliding_window, rope=t, rotary=a.rotary) for a, t in zip(layers, types)]


def rotary_dim(config: PretrainedConfig) -> int:
    """How many channels of each head rotate (the rope table's width, as :mod:`qworker.model.rope`
    builds it: ``partial_rotary_factor``, or GPT-J's ``rotary_dim``)."""
    return int(dims(config).head_dim * (rope_parameters(config)["partial_rotary_factor"] or 1.0))


def reorder_qk(qkv: torch.Tensor | None, d: Dims, reorder: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    """Fused q/k/v rows (or their biases) with ``reorder`` applied to the q rows and to the k rows."""
    if qkv is None:
        return None
    q, kv = d.q_size, d.q_size + d.kv_size
    return torch.cat([reorder(qkv[:q]), reorder(qkv[q:kv]), qkv[kv:]])


def no_affine_norm(hidden: int) -> torch.Tensor:
    """A LayerNorm without weights as RawLayer holds LayerNorms: ``[2, H]`` of ones, then zeros."""
    return torch.stack([torch.ones(hidden), torch.zeros(hidden)])


def rotate_halves_not_pairs(t: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """``t``'s rows (q or k weight rows, their biases, a LoRA B: ``[heads * head_dim, ...]``) with
    each head's first ``rotary_dim`` channels reordered evens first, then odds. Rotary on
    interleaved pairs (channels 2j and 2j+1 by frequency j: GLM) is then rotary on halves (j and
    j + rotary_dim / 2: the kernels' form); q.k is unchanged, as q and k get the same order."""
    order = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2), torch.arange(rotary_dim, head_dim)])
    heads = t.shape[0] // head_dim
    return t.reshape(heads, head_dim, *t.shape[1:])[:, order].reshape(t.shape)


def renamed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    """``name`` with the first of ``prefixes``' ``(old, new)`` it starts with replaced."""
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def per_head_to_grouped(t: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Fused q/k/v rows laid out per head (``[heads, (q, k, v), head_dim, ...]``: GPT-NeoX,
    GPT-BigCode without multi_query) regrouped as the decoder holds them: all q rows, then k, then v."""
    return t.reshape(heads, 3, head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
