"""Read a PEFT LoRA adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) for a
base model, refusing anything that does not fit it with one :class:`LoRAAdapterError` line that
names the offending file or field.

Checks, in the order they run (each before any later work, so a hostile folder costs little):

1. The folder: it exists, resolves inside ``root`` when one is given, and no entry in it (nor the
   folder itself, relative to the directory it sits in) is a symlink that leads outside it.
   ``adapter_config.json`` and ``adapter_model.safetensors`` are regular files (a FIFO would block
   the reader); a folder with only ``adapter_model.bin`` is refused: pickles are never loaded.
2. ``adapter_config.json``: a JSON object of at most 1 MiB; ``peft_type`` ``LORA``; ``r`` (and
   every ``rank_pattern`` value) an int in ``1..max_rank``; ``lora_alpha`` (and ``alpha_pattern``)
   finite numbers; ``target_modules`` only q/k/v/o/gate/up/down projections (an image-text
   base's may name its vision tower's modules too: their tensors are skipped); no DoRA,
   ``modules_to_save``, biases, or other variants whose forward is not ``x @ A.T @ B.T * s``.
   Pattern keys must be module names (``q_proj``, ``layers.3.self_attn.q_proj``): regular
   expressions from a file are not run (so ``exclude_modules`` must be a list too).
   ``target_modules``, ``layers_to_transform`` and ``exclude_modules`` say which modules are
   adapted, as PEFT decides it (:class:`_Targets`); tensors of other modules are skipped, as PEFT
   never applies them.
3. The safetensors header, read alone (8-byte length + JSON): every name is
   ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight`` with ``i`` a
   layer of the base model and ``module`` allowed there (no MLP module on a MoE layer); for an
   image-text base (:mod:`qworker.model.wrappers`) the layers sit under ``model.language_model.``
   (or transformers 4's ``language_model.model.``), and tensors of its vision tower or projector
   are skipped (a text-only prompt never runs them); dtypes
   are floats; shapes are ``A [r, in]`` and ``B [out, r]`` with the base model's features and the
   rank the config gives that module; data offsets fit the file. Huge declared shapes are thus
   refused before a byte of tensor data is read.
4. The tensors: read, converted to fp32, finite (NaN or Inf refused), scaling folded into B.

Scaling follows PEFT: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``, where
``r`` and ``lora_alpha`` are the module's (``rank_pattern`` / ``alpha_pattern`` matched against
the module's name in the model PEFT trained on, as the tensor's name gives it
(``model.layers.{i}.{self_attn|mlp}.{module}``; ``model.language_model.layers...`` or
``language_model.model.layers...`` for an image-text base), as PEFT matches them: the pattern
equals the key or a dot-separated suffix of it).
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from transformers import PretrainedConfig

from qworker.model.families import spec_for
from qworker.model.families.spec import ATTENTION_LORA, LORA_MODULES, DecoderSpec, dims
from qworker.model.wrappers import LORA_IMAGE_PARTS, LORA_LAYER_PREFIXES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = LORA_MODULES  # q/k/v/o, then gate/up/down
ATTENTION_MODULES = ATTENTION_LORA
MLP_MODULES = MODULES[len(ATTENTION_MODULES):]

_MAX_CONFIG_BYTES = 1 << 20
_MAX_HEADER_BYTES = 32 << 20
_MAX_FOLDER_ENTRIES = 10_000
# PEFT's defaults where the config omits them
_DEFAULT_R = 8
_DEFAULT_ALPHA = 8
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
# the decoder layers' prefix, the layer, self_attn|mlp, the module, A|B
_TENSOR_NAME = re.compile(r"base_model\.model\.((?:model\.|model\.language_model\.|language_model\.model\.)?)layers\.(\d{1,6})\."
                          r"(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_PATTERN_KEY = re.compile(r"[A-Za-z0-9_.]{1,200}")
# config fields whose truthy value means a forward other than plain LoRA's
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (use_dora) adapters are not supported",
    "modules_to_save": "modules_to_save is not supported (it replaces whole base-model modules)",
    "lora_bias": "lora_bias is not supported (LoRA B biases)",
    "target_parameters": "target_parameters is not supported (LoRA on raw parameters, e.g. MoE experts)",
    "layer_replication": "layer_replication is not supported",
    "trainable_token_indices": "trainable_token_indices is not supported (it changes embeddings)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "use_bdlora": "use_bdlora is not supported",
    "arrow_config": "arrow_config (routing between LoRA experts) is not supported",
}


class LoRAAdapterError(ValueError):
    """An adapter folder that cannot serve this base model; the message names the file or field."""


@dataclass(slots=True)
class LoRAAdapter:
    """A validated adapter. ``weights[(layer, module)] = (A [r, in], B [out, r])``, fp32 CPU
    tensors, the module's scaling already folded into ``B``; ``rank`` is the largest ``r``."""

    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    path: str = ""
    target_modules: frozenset[str] = field(default_factory=frozenset)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_lora_adapter(path: str | Path, config: PretrainedConfig, max_rank: int, root: str | Path | None = None) -> LoRAAdapter:
    """Validates and reads the adapter at ``path`` for a base model of ``config`` (see the module
    docstring); ``root``: the folder every adapter must resolve inside (symlinks followed)."""
    folder = _checked_folder(Path(path), root)
    # an image-text base's adapter may target vision-tower modules too (skipped: see _expected_shapes)
    cfg = _read_config(folder / CONFIG_FILE, max_rank, image_text=getattr(config, "wrapped_by", None) is not None)
    weights_path = folder / WEIGHTS_FILE
    # read once, then parsed from memory: a file rewritten while it loads (the reload loop reads
    # adapters whenever an operator saves one) then gives one snapshot, not a memory map whose
    # pages change under the reader or vanish (SIGBUS) when the file is cut short
    try:
        data = weights_path.read_bytes()
    except OSError as exc:
        raise LoRAAdapterError(f"{weights_path}: cannot read it ({exc.strerror or exc})") from None
    header = _read_header(weights_path, data)
    spec = spec_for(config)
    expected = _expected_shapes(header, cfg, config, spec, max_rank, weights_path)
    try:
        weights = _read_tensors(weights_path, data, expected)
    except SafetensorError as exc:  # what the header check leaves to safetensors: overlapping or uncovered data
        raise LoRAAdapterError(f"{weights_path}: not a valid safetensors file ({exc})") from None
    reorder = spec.qk_rows  # q/k rows in the order the family's layers hold them (GLM, Cohere)
    if reorder is not None:
        weights = {(layer, m): (a, reorder(b) if m in ("q_proj", "k_proj") else b) for (layer, m), (a, b) in weights.items()}
    rank = max(a.shape[0] for a, _ in weights.values())
    return LoRAAdapter(rank=rank, weights=weights, path=str(folder), target_modules=frozenset(m for _, m in weights))


def _read_tensors(weights_path: Path, data: bytes, expected: dict) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The A/B pairs ``expected`` names, fp32, scaling folded into B, all finite, from the file's
    bytes ``data`` (``safetensors.torch.load`` gives each tensor a buffer of its own, never a
    view of the file)."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    tensors = safetensors_load(data)
    for (layer, module), (a_name, b_name, scaling) in sorted(expected.items()):
        a = tensors[a_name].to(torch.float32)
        b = tensors[b_name].to(torch.float32) * scaling
        for name, t in ((a_name, a), (b_name, b)):
            if not torch.isfinite(t).all():
                what = "NaN or Inf" if name == a_name or math.isfinite(scaling) else "non-finite scaling"
                raise LoRAAdapterError(f"{weights_path}: tensor {name!r} has {what} values")
        weights[layer, module] = (a.contiguous(), b.contiguous())
    return weights


def moe_layers(config: PretrainedConfig) -> set[int]:
    """The layers whose MLP is a sparse mixture of experts (no MLP LoRA there), as the families
    in :mod:`qworker.model.families` read them."""
    n = config.num_hidden_layers
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    if not experts:
        return set()
    if config.model_type in ("qwen3_moe", "qwen2_moe"):  # their dense layers as qwen3_moe.py reads them
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense_only = set(getattr(config, "mlp_only_layers", None) or [])
        return {i for i in range(n) if i not in dense_only and (i + 1) % step == 0}
    if hasattr(config, "first_k_dense_replace"):  # GLM-4.5, DeepSeek: dense MLPs before that layer
        return set(range(config.first_k_dense_replace, n))
    return set(range(n))


def _inside(p: Path, folder: Path) -> bool:
    return p == folder or folder in p.parents


def _resolve(p: Path) -> Path:
    """``p.resolve()``, a symlink loop refused as the adapter's fault (pathlib raises
    RuntimeError or OSError for one, depending on the Python version)."""
    try:
        return p.resolve()
    except (RuntimeError, OSError) as exc:
        raise LoRAAdapterError(f"{p}: cannot be resolved ({exc})") from None


def _checked_folder(path: Path, root: str | Path | None) -> Path:
    """The adapter folder, resolved, after the location and symlink checks."""
    if not path.exists():
        raise LoRAAdapterError(f"LoRA adapter folder {str(path)!r} does not exist")
    if not path.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {str(path)!r} is not a folder")
    folder = _resolve(path)
    if root is not None:
        root_dir = Path(root).resolve()
        if not _inside(folder, root_dir):
            raise LoRAAdapterError(f"LoRA adapter folder {str(path)!r} resolves to {str(folder)!r}, outside the adapter root {str(root_dir)!r}")
    elif path.is_symlink():
        parent = _resolve(path.absolute().parent)
        if not _inside(folder, parent):
            raise LoRAAdapterError(f"LoRA adapter folder {str(path)!r} is a symlink to {str(folder)!r}, outside {str(parent)!r}")
    with os.scandir(folder) as entries:
        for count, entry in enumerate(entries):
            if count >= _MAX_FOLDER_ENTRIES:
                raise LoRAAdapterError(f"LoRA adapter folder {str(path)!r} has more than {_MAX_FOLDER_ENTRIES} entries")
            if entry.is_symlink():
                target = _resolve(Path(entry.path))
                if not _inside(target, folder):
                    raise LoRAAdapterError(f"{entry.path}: a symlink to {str(target)!r}, outside the adapter folder")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        f = folder / name
        if not f.exists():
            if name == WEIGHTS_FILE and (folder / "adapter_model.bin").exists():
                raise LoRAAdapterError(f"{folder}: only adapter_model.bin found; adapter weights are read from {WEIGHTS_FILE} only "
                                       "(pickled .bin files are never loaded)")
            raise LoRAAdapterError(f"{folder}: {name} is missing")
        if not stat.S_ISREG(f.stat().st_mode):
            raise LoRAAdapterError(f"{f}: not a regular file")
    return folder


@dataclass(slots=True)
class _Targets:
    """Which modules the config adapts, decided as PEFT's ``check_target_module_exists`` does, on
    the key ``model.layers.{i}.{self_attn|mlp}.{module}``: not when ``exclude_modules`` names it
    (the key or a dot-suffix of it); else, for a list ``target_modules``, when an entry is the key,
    or is a dot-suffix of it in a layer ``layers_to_transform`` lists (all layers without it). A
    string ``target_modules`` (a regular expression, or ``all-linear``) is not run: the tensors
    PEFT saved for it are what it adapted. Tensors of modules not adapted are skipped, as PEFT
    loads them (unexpected keys, never applied)."""

    names: tuple[str, ...] | None  # None: a string target_modules
    layers: frozenset[int] | None  # None: every layer
    exclude: tuple[str, ...]

    def adapts(self, key: str, layer: int) -> bool:
        if key in self.exclude or any(key.endswith("." + e) for e in self.exclude):
            return False
        if self.names is None or key in self.names:
            return True
        return any(key.endswith("." + t) for t in self.names) and (self.layers is None or layer in self.layers)


@dataclass(slots=True)
class _Config:
    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    targets: _Targets

    def module_rank_alpha(self, key: str) -> tuple[int, float]:
        return _match(self.rank_pattern, key, self.r), _match(self.alpha_pattern, key, self.alpha)


def _match(patterns: dict, key: str, default):
    """PEFT's ``get_pattern_key``: the first pattern that is ``key`` or a dot-suffix of it."""
    for pattern, value in patterns.items():
        if key == pattern or key.endswith("." + pattern):
            return value
    return default


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _read_config(path: Path, max_rank: int, image_text: bool = False) -> _Config:
    if path.stat().st_size > _MAX_CONFIG_BYTES:
        raise LoRAAdapterError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: arrays nested past the stack
        raise LoRAAdapterError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{path}: must be a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type") != "LORA":
        raise LoRAAdapterError(f"{path}: peft_type must be 'LORA', got {cfg.get('peft_type')!r}")
    for key, why in _UNSUPPORTED_FLAGS.items():
        if cfg.get(key):
            raise LoRAAdapterError(f"{path}: {why} ({key}={cfg[key]!r})")
    if cfg.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{path}: bias must be 'none' (biases of the base layers are not trained here), got {cfg['bias']!r}")
    r = cfg.get("r", _DEFAULT_R)
    if not _is_int(r) or r < 1:
        raise LoRAAdapterError(f"{path}: r must be an int >= 1, got {r!r}")
    if r > max_rank:
        raise LoRAAdapterError(f"{path}: r={r} exceeds max_lora_rank={max_rank}")
    alpha = cfg.get("lora_alpha", _DEFAULT_ALPHA)
    if not _is_number(alpha):
        raise LoRAAdapterError(f"{path}: lora_alpha must be a finite number, got {alpha!r}")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoRAAdapterError(f"{path}: use_rslora must be true or false, got {rslora!r}")
    rank_pattern = _pattern(path, cfg, "rank_pattern")
    for key, v in rank_pattern.items():
        if not _is_int(v) or v < 1:
            raise LoRAAdapterError(f"{path}: rank_pattern[{key!r}] must be an int >= 1, got {v!r}")
        if v > max_rank:
            raise LoRAAdapterError(f"{path}: rank_pattern[{key!r}]={v} exceeds max_lora_rank={max_rank}")
    alpha_pattern = _pattern(path, cfg, "alpha_pattern")
    for key, v in alpha_pattern.items():
        if not _is_number(v):
            raise LoRAAdapterError(f"{path}: alpha_pattern[{key!r}] must be a finite number, got {v!r}")
    return _Config(r, float(alpha), rslora, rank_pattern, alpha_pattern, _read_targets(path, cfg, image_text))


def _pattern(path: Path, cfg: dict, field_name: str) -> dict:
    value = cfg.get(field_name) or {}
    if not isinstance(value, dict):
        raise LoRAAdapterError(f"{path}: {field_name} must be an object, got {type(value).__name__}")
    for key in value:
        if not _PATTERN_KEY.fullmatch(key):
            raise LoRAAdapterError(f"{path}: {field_name} key {key!r} is not a module name (letters, digits, '_' and '.'; "
                                   "regular expressions are not supported)")
    return value


def _read_targets(path: Path, cfg: dict, image_text: bool = False) -> _Targets:
    """``target_modules``, ``layers_to_transform`` (with ``layers_pattern``) and
    ``exclude_modules``, checked: a list names modules by their last component(s); a string
    ``target_modules`` is PEFT's regex or ``all-linear``, checked through the tensors it produced
    instead; regular expressions from a file are never run, so a string ``exclude_modules`` is
    refused."""
    targets = cfg.get("target_modules")
    if targets is None:  # PEFT would pick a per-architecture default (q_proj and v_proj for most)
        raise LoRAAdapterError(f"{path}: target_modules is missing; list the modules the adapter adapts "
                               "(PEFT writes them when it saves an adapter)")
    if not isinstance(targets, str):
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise LoRAAdapterError(f"{path}: target_modules must be a list of module names or a string, got {targets!r}")
        # an image-text base: other names may be its vision tower's or projector's (PEFT's "all-linear"
        # lists them all); their tensors are skipped and any in the language model refused by name
        bad = [] if image_text else sorted({t for t in targets if t.rsplit(".", 1)[-1] not in MODULES})
        if bad:
            raise LoRAAdapterError(f"{path}: target_modules {bad} not supported; LoRA applies to {', '.join(MODULES)} only")
    exclude = cfg.get("exclude_modules") or []
    if isinstance(exclude, str):
        raise LoRAAdapterError(f"{path}: exclude_modules {exclude!r} is a regular expression; list the module names instead "
                               "(regular expressions from a file are not run)")
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise LoRAAdapterError(f"{path}: exclude_modules must be a list of module names, got {exclude!r}")
    layers = cfg.get("layers_to_transform")
    if _is_int(layers):
        layers = [layers]
    if layers is not None and not (isinstance(layers, list) and all(_is_int(i) and i >= 0 for i in layers)):
        raise LoRAAdapterError(f"{path}: layers_to_transform must be a layer index or a list of them, got {layers!r}")
    pattern = cfg.get("layers_pattern") or []
    patterns = [pattern] if isinstance(pattern, str) else pattern
    if not (isinstance(patterns, list) and all(isinstance(p, str) for p in patterns)):
        raise LoRAAdapterError(f"{path}: layers_pattern must be a name or a list of names, got {pattern!r}")
    if patterns and not layers:
        raise LoRAAdapterError(f"{path}: layers_pattern is set without layers_to_transform (PEFT refuses it too)")
    # PEFT finds the layer index after the first pattern that precedes ".N." in the module's name
    if patterns and not any(re.match(rf"(?:.*\.)?{re.escape(p)}\.\d+\.", "model.layers.0.self_attn.q_proj") for p in patterns):
        raise LoRAAdapterError(f"{path}: layers_pattern {pattern!r} does not name this model's layers (model.layers.N)")
    return _Targets(None if isinstance(targets, str) else tuple(targets), frozenset(layers) if layers else None, tuple(exclude))


def _read_header(path: Path, data: bytes) -> dict:
    """The safetensors header of ``data`` (the file at ``path``), without ``__metadata__``,
    checked for dtypes and offsets only."""
    size = len(data)
    if size < 8:
        raise LoRAAdapterError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    n = int.from_bytes(data[:8], "little")
    if n > min(size - 8, _MAX_HEADER_BYTES):
        raise LoRAAdapterError(f"{path}: not a safetensors file (header length {n} for a file of {size} bytes)")
    raw = data[8 : 8 + n]

    def no_duplicates(pairs):
        d = {}
        for k, v in pairs:
            if k in d:
                raise LoRAAdapterError(f"{path}: tensor {k!r} appears twice in the header")
            d[k] = v
        return d

    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        if isinstance(exc, LoRAAdapterError):
            raise
        raise LoRAAdapterError(f"{path}: not a safetensors file (header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise LoRAAdapterError(f"{path}: not a safetensors file (header is not an object)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, info in header.items():
        if not isinstance(info, dict):
            raise LoRAAdapterError(f"{path}: tensor {name!r} has a malformed header entry")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _DTYPE_BYTES:
            raise LoRAAdapterError(f"{path}: tensor {name!r} has dtype {dtype!r}; LoRA weights must be F32, F16, BF16 or F64")
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
            raise LoRAAdapterError(f"{path}: tensor {name!r} has a malformed shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise LoRAAdapterError(f"{path}: tensor {name!r} has malformed data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size or end - begin != math.prod(shape) * _DTYPE_BYTES[dtype]:
            raise LoRAAdapterError(f"{path}: tensor {name!r} data_offsets {offsets} do not fit its shape {shape} or the file")
    return header


def _module_features(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a (dense) layer."""
    d = dims(config)
    inter = getattr(config, "intermediate_size", None)
    feats = {"q_proj": (d.hidden, d.q_size), "k_proj": (d.hidden, d.kv_size), "v_proj": (d.hidden, d.kv_size),
             "o_proj": (d.q_size, d.hidden)}
    if inter:
        feats.update(gate_proj=(d.hidden, inter), up_proj=(d.hidden, inter), down_proj=(inter, d.hidden))
    return feats


def _unsupported_name(name: str) -> str:
    """Why a tensor name is not one of ours, naming what it targets where that can be told."""
    stem = name.split(".lora_")[0] if ".lora_" in name else name
    module = stem.rsplit(".", 1)[-1]
    if "lora_magnitude_vector" in name:
        return f"tensor {name!r} is a DoRA magnitude vector (DoRA is not supported)"
    if "lora_embedding" in name or module in ("embed_tokens", "lm_head"):
        return f"tensor {name!r} targets {module}; LoRA applies to {', '.join(MODULES)} only"
    if name.endswith(".bias"):
        return f"tensor {name!r} is a LoRA bias (lora_bias is not supported)"
    if ".experts." in name or ".shared_expert." in name:
        return f"tensor {name!r} targets a MoE expert; LoRA on experts is not supported"
    return f"tensor {name!r} is not a LoRA A/B weight of {', '.join(MODULES)} in model.layers.N"


def _module_key(layers: str, layer: int, module: str) -> str:
    """A module's name in the base model (``layers``: its decoder layers' prefix), as PEFT's
    patterns and targets are matched against it."""
    return f"{layers}layers.{layer}.{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{module}"


def _expected_shapes(header: dict, cfg: _Config, config: PretrainedConfig, spec: DecoderSpec, max_rank: int, path: Path) -> dict:
    """``{(layer, module): (A name, B name, scaling)}`` after every name and shape check."""
    feats = _module_features(config)
    moe = moe_layers(config)
    n_layers = config.num_hidden_layers
    wrapped = getattr(config, "wrapped_by", None) is not None
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    keys: dict[tuple[int, str], str] = {}  # the module's name in the model PEFT trained on (its patterns match it)
    for name in header:
        if wrapped and name.startswith(LORA_IMAGE_PARTS):
            continue  # the vision tower's or projector's: never run for a text-only prompt
        m = _TENSOR_NAME.fullmatch(name)
        if m is None or m[1] != "model." and not (wrapped and m[1] in LORA_LAYER_PREFIXES):
            raise LoRAAdapterError(f"{path}: {_unsupported_name(name)}")
        layer, group, module, ab = int(m[2]), m[3], m[4], m[5]
        key = _module_key(m[1], layer, module)
        if module not in MODULES:
            raise LoRAAdapterError(f"{path}: {_unsupported_name(name)}")
        if (group == "self_attn") != (module in ATTENTION_MODULES):
            raise LoRAAdapterError(f"{path}: tensor {name!r}: {module} does not sit under {group}")
        if layer >= n_layers:
            raise LoRAAdapterError(f"{path}: tensor {name!r} is for layer {layer}; the base model has {n_layers} layers")
        if not cfg.targets.adapts(key, layer):
            continue  # PEFT never applies it (see _Targets)
        if module not in spec.lora_modules:  # PEFT would find no such module and drop the tensor; never apply it elsewhere
            raise LoRAAdapterError(f"{path}: tensor {name!r} targets {module}, which {config.model_type} models do not have as a "
                                   f"LoRA target (LoRA applies to {', '.join(spec.lora_modules) or 'none of their modules'} there)")
        if module in MLP_MODULES and (layer in moe or module not in feats):
            raise LoRAAdapterError(f"{path}: tensor {name!r} targets {module} of layer {layer}, a mixture-of-experts layer "
                                   "(LoRA on MoE MLPs is not supported)")
        found = pairs.setdefault((layer, module), {})
        if ab in found:  # the same weight under both of a wrapper's prefixes
            raise LoRAAdapterError(f"{path}: tensors {found[ab]!r} and {name!r} are the same LoRA weight")
        found[ab] = name
        keys[layer, module] = key
    if not pairs:
        raise LoRAAdapterError(f"{path}: holds no LoRA tensors" + (" for the modules its adapter_config.json targets" if header else ""))
    out = {}
    for (layer, module), names in pairs.items():
        for ab in "AB":
            if ab not in names:
                other = next(iter(names.values()))
                raise LoRAAdapterError(f"{path}: tensor {other!r} has no lora_{ab} partner")
        a_name, b_name = names["A"], names["B"]
        r, alpha = cfg.module_rank_alpha(keys[layer, module])
        fin, fout = feats[module]
        a_shape, b_shape = header[a_name]["shape"], header[b_name]["shape"]
        if len(a_shape) == 2 and a_shape[0] > max_rank:
            raise LoRAAdapterError(f"{path}: tensor {a_name!r} has rank {a_shape[0]}, above max_lora_rank={max_rank}")
        if a_shape != [r, fin]:
            raise LoRAAdapterError(f"{path}: tensor {a_name!r} has shape {a_shape}, expected {[r, fin]} "
                                   f"(rank {r} from adapter_config.json, {fin} input features in the base model)")
        if b_shape != [fout, r]:
            raise LoRAAdapterError(f"{path}: tensor {b_name!r} has shape {b_shape}, expected {[fout, r]} "
                                   f"({fout} output features in the base model, rank {r} from adapter_config.json)")
        scaling = alpha / math.sqrt(r) if cfg.rslora else alpha / r
        out[layer, module] = (a_name, b_name, scaling)
    return out


__all__ = ["LoRAAdapter", "LoRAAdapterError", "load_lora_adapter", "moe_layers", "MODULES"]
