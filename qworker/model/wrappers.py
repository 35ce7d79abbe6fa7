"""Image-text checkpoints served as the language model inside them: Gemma 3 (4B and up,
``gemma3``), Llama 4 (Scout and Maverick, ``llama4``), Mistral 3 (Mistral Small 3.1 and 3.2,
``mistral3``), LLaVA (``llava``), Aya Vision (``aya_vision``), InternVL 3 (``internvl``) and
Qwen2-VL, Qwen2.5-VL and Qwen3-VL (``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``: their multimodal
rope gives a text-only prompt's tokens the same position on its three axes, which is plain rope).

Such a folder holds a vision tower, a projector and a language model of a family this engine
serves (``config.text_config``). Jobs carry text only, and a text-only prompt never runs the
tower or the projector (transformers runs them only for image tokens), so the engine serves the
language model: its config is ``text_config`` and its weights are the checkpoint's language-model
tensors renamed to the causal-LM names the families read (``model.layers.N...``, ``lm_head``);
the tower's and projector's tensors are not read.

The LM head is tied where ``config.json`` says so in either place (transformers 4 reads the text
config's ``tie_word_embeddings``, transformers 5 the top-level one, and each writes both), by the
text model's default where it says nothing. As for any model, a stored ``lm_head`` that differs
from the embedding is served (with a warning where the config says tied), and an untied model
without one is refused.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from qworker.model.families.spec import renamed

WRAPPERS = ("aya_vision", "gemma3", "internvl", "llama4", "llava", "mistral3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# the language model's names in the checkpoint (transformers 4 saves the first form, transformers
# 5 keeps the second in memory) -> the causal-LM names
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
# parts that only images run
_IMAGE_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.", "visual.",
                "model.visual.", "vision_model.", "model.vision_model.")
# where PEFT names the language model's decoder layers in an adapter trained on the wrapper
LORA_LAYER_PREFIXES = ("model.language_model.", "language_model.model.")
LORA_IMAGE_PARTS = tuple(f"base_model.model.{p}" for p in _IMAGE_PARTS)


def is_wrapper(model_type: str | None) -> bool:
    return model_type in WRAPPERS


def text_config(config: PretrainedConfig, raw: dict) -> PretrainedConfig:
    """The language model's config of wrapper ``config`` (``raw``: its ``config.json`` as read),
    marked with ``wrapped_by`` (the wrapper's model type, which the LoRA reader names modules by)."""
    text = config.get_text_config()
    if text is config or not getattr(text, "model_type", None):
        raise ValueError(f"{config.model_type}: config.json has no text_config")
    raw_text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    flags = [d["tie_word_embeddings"] for d in (raw_text, raw) if "tie_word_embeddings" in d]
    # neither level says: the text model's default where its config class has one (Qwen-VL's have none: the wrapper's)
    default = getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False))
    text.tie_word_embeddings = any(flags) if flags else bool(default)
    text.wrapped_by = config.model_type
    return text


def text_weight_name(name: str) -> str | None:
    """A wrapper checkpoint's tensor name as the text model's (None: an image-only part, not
    read). Other names are kept, so that the decoder refuses them by name as tensors it does not use."""
    return None if name.startswith(_IMAGE_PARTS) else renamed(name, _TEXT_PREFIXES)
