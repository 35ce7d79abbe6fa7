"""xgrammar's view of a model's vocabulary: built once per model, shared by every compile.

The mask width is the model's vocabulary (the lm_head rows, ``config.vocab_size``), which may
exceed the tokenizer's length (padded heads) or fall short of it (added tokens the head lacks);
xgrammar takes the model's size and masks ids the tokenizer has no text for.

Special tokens: xgrammar 0.2.8's ``from_huggingface`` reports no special tokens for SmolLM2 and
treats ``<|im_start|>``, ``<repo_name>`` etc. as their literal text, so a JSON string could
contain them; the engine's detokenizer drops special tokens, and the text the caller gets would
no longer be what the grammar accepted. We blank them (xgrammar never allows a token without
text), except the stop tokens, which the matcher handles by id.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable

import xgrammar as xgr


def model_vocab_size(config: object) -> int | None:
    """``vocab_size`` of a transformers config (or of its ``text_config`` for multimodal ones)."""
    for cfg in (config, getattr(config, "text_config", None)):
        v = getattr(cfg, "vocab_size", None)
        if isinstance(v, int) and v > 0:
            return v
    return None


# built infos by (tokenizer folder and its files' stamps, the tokenizer's length and special ids,
# logits width, stops): an engine made again in the same process (tests, benchmarks, a restarted
# engine) reuses the info (immutable) instead of spending ~0.75 s of CPU on a 50k vocabulary again
_built: dict[tuple, xgr.TokenizerInfo] = {}
_built_lock = threading.Lock()
_BUILT_KEPT = 4  # the oldest goes beyond this (a process that loads many models keeps the last few)


def build_tokenizer_info(tokenizer: object, vocab_size: int | None = None, stop_token_ids: Iterable[int] | None = None) -> xgr.TokenizerInfo:
    """``vocab_size``: the logits width; defaults to the tokenizer's length. ``stop_token_ids``:
    the ids that end a sequence (pass the engine's EOS set, so the grammar allows exactly those
    once it may end); defaults to the tokenizer's EOS."""
    size = vocab_size if vocab_size is not None else len(tokenizer)  # type: ignore[arg-type]
    stops = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < size}) if stop_token_ids is not None else None
    stamp = _folder_stamp(getattr(tokenizer, "name_or_path", ""))
    if stamp is None:  # not loaded from a folder: nothing to key it by
        return _build(tokenizer, size, stops)
    key = (stamp, len(tokenizer), tuple(sorted(special_token_ids(tokenizer))), size, stops and tuple(stops))  # type: ignore[arg-type]
    with _built_lock:
        info = _built.get(key)
    if info is None:
        info = _build(tokenizer, size, stops)
        with _built_lock:
            _built[key] = info
            while len(_built) > _BUILT_KEPT:
                del _built[next(iter(_built))]
    return info


def _folder_stamp(folder: str) -> tuple | None:
    """The folder and (name, mtime, size) of its files, or None if it is not a folder."""
    try:
        with os.scandir(folder) as entries:
            files = sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size) for e in entries if e.is_file())
    except (OSError, TypeError):
        return None
    return (os.path.realpath(folder), tuple(files))


def _build(tokenizer: object, size: int, stops: list[int] | None) -> xgr.TokenizerInfo:
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size, stop_token_ids=stops or None)
    special = (special_token_ids(tokenizer) - set(base.stop_token_ids)) & set(range(size))
    if not special:
        return base
    encoded = [""] * size
    for token, idx in tokenizer.get_vocab().items():  # type: ignore[attr-defined]
        if idx < size and idx not in special:
            encoded[idx] = token
    meta = json.loads(base.dump_metadata())
    return xgr.TokenizerInfo(encoded, xgr.VocabType(meta["vocab_type"]), vocab_size=size,
                             stop_token_ids=base.stop_token_ids, add_prefix_space=meta["add_prefix_space"])


def special_token_ids(tokenizer: object) -> set[int]:
    """Ids of the tokenizer's special tokens (``all_special_ids`` and added tokens marked special)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    for idx, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(idx))
    return ids


def load_tokenizer_info(model_path: str, stop_token_ids: Iterable[int] | None = None) -> xgr.TokenizerInfo:
    """The tokenizer info for a HF model folder (its tokenizer and ``config.json``)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return build_tokenizer_info(tokenizer, model_vocab_size(AutoConfig.from_pretrained(model_path)), stop_token_ids)
