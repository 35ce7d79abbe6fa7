"""Load a checkpoint of a supported family (:mod:`qworker.model.families`) from safetensors (or
PyTorch's ``pytorch_model.bin``) + transformers' config."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, PretrainedConfig

from qworker.model import fp8
from qworker.model.families import CHECKPOINT_NAMES, FAMILIES, KEEP_FP32, SUPPORTED
from qworker.model.wrappers import WRAPPERS, is_wrapper, text_config, text_weight_name

try:  # transformers 5.x validates configs strictly through huggingface_hub; older hubs lack the type
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # pragma: no cover - depends on the installed huggingface_hub
    class StrictDataclassError(Exception):  # type: ignore[no-redef]
        """Never raised: stands in where huggingface_hub has no strict dataclasses."""


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # checkpoint dtypes read as weights


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 on CPU: bf16 matmuls are extremely slow on these CPUs
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16; got {name!r}") from None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_config(model_dir: str | Path) -> PretrainedConfig:
    """The model's transformers config (an image-text checkpoint's language-model config, see
    :mod:`qworker.model.wrappers`); a ValueError of one line for a model type no family serves
    (including one transformers itself does not know)."""
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    try:
        raw = json.loads((path / "config.json").read_text())
    except ValueError as exc:
        raise ValueError(f"{model_dir}/config.json: not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{model_dir}/config.json: not a JSON object")
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as exc:
        # transformers validates configs as strict dataclasses: their error wraps the one that says why
        model_type = raw.get("model_type")
        if model_type not in FAMILIES and not is_wrapper(model_type):
            raise ValueError(f"unsupported model type {model_type!r}; supported: {', '.join(SUPPORTED)}") from None
        why = exc.__cause__ if isinstance(exc, StrictDataclassError) and exc.__cause__ is not None else exc
        raise ValueError(f"{model_dir}/config.json: {(str(why).strip().splitlines() or [type(why).__name__])[0]}") from None
    if is_wrapper(config.model_type):
        outer, config = config.model_type, text_config(config, raw)
        if config.model_type not in FAMILIES:
            raise ValueError(f"unsupported model type {config.model_type!r} (the language model of this {outer} checkpoint); "
                             f"supported: {', '.join(SUPPORTED)}")
    elif config.model_type not in FAMILIES:
        raise ValueError(f"unsupported model type {config.model_type!r}; supported: {', '.join(SUPPORTED)} "
                         f"(and the image-text {', '.join(WRAPPERS)}, served as their language model)")
    quant = raw.get("quantization_config") or getattr(config, "quantization_config", None)
    method = (quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")) if quant else None
    # FP8 (fine-grained, or compressed-tensors' float-quantized): dequantized as it is loaded (qworker.model.fp8)
    as_dict = quant if isinstance(quant, dict) else getattr(quant, "to_dict", dict)()
    config.fp8 = fp8.scheme(as_dict, f"{model_dir}/config.json") if quant else None
    # gpt-oss's released MXFP4 experts are dequantized as they are read (qworker.model.families.gpt_oss)
    if quant and config.fp8 is None and not (config.model_type == "gpt_oss" and method == "mxfp4"):
        # packed or scaled weights would be read as plain ones (or fail deep in the loader)
        raise ValueError(f"{model_dir}: quantized checkpoints are not supported (quantization_config: {method}); "
                         "use the unquantized weights (FP8 and gpt-oss's MXFP4 are dequantized at load)")
    return config


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The files that hold the transformers checkpoint, in transformers' order: safetensors
    (``model.safetensors``, else the shards ``model.safetensors.index.json`` names), else PyTorch's
    (``pytorch_model.bin``, else the shards ``pytorch_model.bin.index.json`` names), which older
    uploads have alone; else every ``*.safetensors`` (shards without their index).
    Hub folders often carry other formats' files beside the checkpoint (Mistral's
    ``consolidated.safetensors``, with its own tensor names); reading those would fail the load."""
    path = Path(model_dir)
    for single, index_name in (("model.safetensors", "model.safetensors.index.json"), ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (path / single).exists():
            return [path / single]
        index = path / index_name
        if index.exists():
            return _shards(path, index)
    return sorted(path.glob("*.safetensors"))


def _shards(path: Path, index: Path) -> list[Path]:
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        raise ValueError(f"{index}: not a checkpoint index ({exc})") from None
    missing = [s for s in shards if not (path / s).exists()]
    if missing:
        raise FileNotFoundError(f"{index} names shards that are absent: {', '.join(missing[:3])}")
    return [path / s for s in shards]


def _stored_tensors(path: Path, device: torch.device) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
    """``(name, read)`` for each tensor of one checkpoint file, read lazily. PyTorch files are
    unpickled with ``weights_only`` (tensors and plain containers, never code) and memory-mapped
    where their format allows."""
    if path.suffix == ".safetensors":
        def unreadable(exc: Exception) -> ValueError:  # truncated, not safetensors at all, unreadable
            return ValueError(f"{path}: not a readable safetensors file ({exc})")

        def read(name: str) -> torch.Tensor:
            try:
                return f.get_tensor(name)
            except (SafetensorError, OSError) as exc:
                raise unreadable(exc) from None

        try:
            f = safe_open(str(path), framework="pt", device=str(device))
        except (SafetensorError, OSError) as exc:
            raise unreadable(exc) from None
        with f:
            for name in f.keys():
                yield name, lambda name=name: read(name)
        return
    try:  # to host memory: each tensor moves to the device as it is read (not the ones never read)
        with warnings.catch_warnings():  # torch warns about old pickle protocols: the refusal below is the one line
            warnings.simplefilter("ignore")
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # the legacy (pre-zip) format cannot be memory-mapped
                state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling fails in many ways; each is the file's fault
        raise ValueError(f"{path}: not a readable PyTorch checkpoint ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{path}: not a PyTorch state dict (a mapping of tensor names to tensors)")
    for name, t in state.items():
        yield name, lambda t=t: t.to(device)


def _weight_names(config: PretrainedConfig) -> Callable[[str], str | None] | None:
    """How the checkpoint's tensor names map to those the families read (None: as they are): an
    image-text checkpoint's language model (:func:`load_config` marks its config ``wrapped_by``),
    then a family that names its tensors otherwise (Falcon's inside a wrapper, say)."""
    family = CHECKPOINT_NAMES.get(config.model_type)
    if not getattr(config, "wrapped_by", None):
        return family
    if family is None:
        return text_weight_name
    return lambda name: None if (text := text_weight_name(name)) is None else family(text)


def _prediction_layers(config: PretrainedConfig) -> tuple[str, ...]:
    """Name prefixes of the multi-token-prediction layers that GLM-4.5 and DeepSeek-V3 checkpoints
    store after the last decoder layer (``num_nextn_predict_layers`` of them): draft heads that
    transformers does not read either, so neither does the engine (nor casts them)."""
    first, n = config.num_hidden_layers, int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    return tuple(f"model.layers.{i}." for i in range(first, first + n))


def load_state_dict(model_dir: str | Path, device: torch.device, dtype: torch.dtype,
                    config: PretrainedConfig | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by the name its family reads (:func:`_weight_names`; an
    image-text checkpoint's image-only parts are not read: :mod:`qworker.model.wrappers`).
    ``config``: the folder's, as :func:`load_config` gave it (read again when not given)."""
    files = checkpoint_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin in {model_dir}")
    config = config if config is not None else load_config(model_dir)
    rename = _weight_names(config)
    unread = _prediction_layers(config)
    scheme = getattr(config, "fp8", None)
    fp32 = KEEP_FP32.get(config.model_type, ())
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        for stored, read in _stored_tensors(path, device):
            name = rename(stored) if rename else stored
            if name is None or name.startswith(unread):
                continue
            if name in weights:  # a checkpoint holding one tensor under both naming forms
                raise ValueError(f"{path}: tensor {stored!r} is stored twice (as {name!r} too)")
            t = read()
            # only real numbers are cast (an FP8 checkpoint's scales stay fp32 until its weights are
            # dequantized); anything else (an integer or fp8 export without its quantization
            # config) is refused by name when a family takes it
            keep = t.dtype not in FLOAT_DTYPES or scheme is not None and name.endswith("weight" + scheme.suffix)
            weights[name] = t if keep else t.float() if name.endswith(fp32) else t.to(dtype)
    if scheme is not None:
        fp8.dequantize_weights(weights, scheme, dtype)
    return weights
