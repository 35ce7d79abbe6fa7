"""Offline batch API, named like vLLM's: ``LLM(model_dir).generate(prompts, params)``.

Prompt forms ``generate`` takes (vLLM's first, then qworker's own):

- a string, or ``{"prompt": str}`` (vLLM's ``TextPrompt``);
- ``{"prompt_token_ids": [int, ...]}`` (vLLM's ``TokensPrompt``; its optional ``"prompt"`` is the
  ids' text, shown as ``RequestOutput.prompt``, never encoded), or a bare list of token ids; token
  ids may be a 1-D numpy integer array;
- a chat as a list of ``{"role", "content"}`` messages (rendered with the chat template; vLLM
  users call ``LLM.chat``, which is here too);
- a list or tuple of any of these, one prompt each.

Anything else is refused with an ``InvalidRequestError`` that says what was expected: a dict is
never iterated as its keys and a list of prompt dicts is never taken for a chat. Multi-modal data,
prompt embeddings and encoder/decoder prompts are refused by name.

A call is all or nothing: every prompt, parameter and priority is checked before the first request
is queued, and if anything raises after that (a request the engine refuses, a failed step, an
interrupt) the requests the call queued are aborted, so none of them lingers to run, unreturned,
inside the next call.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from qworker.engine.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine, Prompt
from qworker.engine.lora_request import LoRARequest
from qworker.engine.output_processor import final_output
from qworker.engine.outputs import RequestOutput
from qworker.engine.sampling_params import InvalidRequestError, SamplingParams
from qworker.engine.sequence import Request

# prompt-dict keys of vLLM's that qworker does not serve: refused by name rather than ignored
_UNSUPPORTED_KEYS = {
    "multi_modal_data": "multi-modal input is not supported (text models only)",
    "mm_processor_kwargs": "multi-modal input is not supported (text models only)",
    "multi_modal_uuids": "multi-modal input is not supported (text models only)",
    "prompt_embeds": "prompt embeddings are not supported; pass 'prompt' or 'prompt_token_ids'",
    "token_type_ids": "token_type_ids are not supported (generation models only)",
    "cache_salt": "cache_salt is not supported",
}
_ENCODER_DECODER_KEYS = {"encoder_prompt", "decoder_prompt"}


def _invalid(msg: str) -> InvalidRequestError:
    return InvalidRequestError("invalid_prompt", msg)


def _is_token_id(v: object) -> bool:
    # numpy integers count; bools (numpy's included) do not
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_message(v: object) -> bool:
    return isinstance(v, dict) and "role" in v


def _is_array(v: object) -> bool:
    """A numpy-like array (not imported here: only its ``ndim`` and ``dtype.kind`` are read)."""
    return hasattr(v, "ndim") and hasattr(getattr(v, "dtype", None), "kind") and hasattr(v, "tolist")


def _array_ids(a, where: str) -> list[int]:
    """A 1-D integer array of token ids -> Python ints; any other array is refused."""
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise _invalid(f"{where} must be a 1-D integer array of token ids, got a {a.ndim}-D {a.dtype} array")
    if a.size == 0:
        raise InvalidRequestError("empty_prompt", f"{where} is empty")
    return [int(t) for t in a.tolist()]


def _token_ids(ids: object, where: str) -> list[int]:
    if _is_array(ids):
        return _array_ids(ids, where)
    if not isinstance(ids, (list, tuple)) or not all(_is_token_id(t) for t in ids):
        raise _invalid(f"{where} must be a list of integer token ids")
    return [int(t) for t in ids]


def _from_dict(d: dict, where: str) -> tuple[Prompt, str | None]:
    """A vLLM prompt dict -> (what the engine encodes, the text RequestOutput.prompt shows)."""
    if _ENCODER_DECODER_KEYS & d.keys():
        raise _invalid(f"{where}: encoder/decoder prompts are not supported (decoder-only models)")
    for key, why in _UNSUPPORTED_KEYS.items():
        if d.get(key) is not None:
            raise _invalid(f"{where}: {key!r}: {why}")
    unknown = sorted(map(str, d.keys() - _UNSUPPORTED_KEYS.keys() - {"prompt", "prompt_token_ids"}))
    if unknown:
        raise _invalid(f"{where}: unknown keys {unknown}; a prompt dict has 'prompt' (a string) or 'prompt_token_ids' (token ids)")
    text = d.get("prompt")
    if text is not None and not isinstance(text, str):
        raise _invalid(f"{where}['prompt'] must be a string, got {type(text).__name__}")
    if "prompt_token_ids" in d:  # vLLM's TokensPrompt: the ids run; a "prompt" is their text, for show
        return _token_ids(d["prompt_token_ids"], f"{where}['prompt_token_ids']"), text
    if "prompt" not in d:
        raise _invalid(f"{where}: a prompt dict needs 'prompt' (a string) or 'prompt_token_ids' (token ids)")
    if not isinstance(d["prompt"], str):
        raise _invalid(f"{where}['prompt'] must be a string, got {type(d['prompt']).__name__}")
    return d["prompt"], d["prompt"]


def _one(p: object, where: str) -> tuple[Prompt, str | None]:
    """One prompt in any accepted form -> (what the engine encodes, the text to show)."""
    if isinstance(p, str):
        return p, p
    if _is_array(p):
        return _array_ids(p, where), None
    if isinstance(p, dict):
        if _is_message(p):
            raise _invalid(f"{where} is a chat message; a chat is a list of messages (or use LLM.chat)")
        return _from_dict(p, where)
    if isinstance(p, (list, tuple)):
        items = list(p)
        if items and all(_is_token_id(t) for t in items):
            return [int(t) for t in items], None
        if items and all(_is_message(m) for m in items):
            return items, None  # a chat: the engine renders it with the chat template
        if not items:
            raise InvalidRequestError("empty_prompt", f"{where} is empty")
        raise _invalid(f"{where} must be token ids or chat messages (dicts with 'role' and 'content'); got items of type "
                       f"{sorted({type(t).__name__ for t in items})}")
    raise _invalid(f"{where} must be a string, a prompt dict, token ids or chat messages, got {type(p).__name__}")


def parse_prompts(prompts: object) -> list[tuple[Prompt, str | None]]:
    """``generate``'s first argument -> one (engine prompt, shown text) per prompt; see the module
    docstring for the forms. One prompt or a batch is decided by type, never by trying."""
    if isinstance(prompts, (str, dict)) or _is_array(prompts):
        return [_one(prompts, "the prompt")]
    if not isinstance(prompts, (list, tuple)):
        raise _invalid(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    items = list(prompts)
    if not items:
        return []
    if all(_is_token_id(t) for t in items) or all(_is_message(m) for m in items):
        return [_one(items, "the prompt")]  # one prompt given as token ids or as one chat
    if any(_is_token_id(t) for t in items):
        raise _invalid("prompts mixes token ids with other items; a batch of token-id prompts is a list of lists")
    return [_one(p, f"prompts[{i}]") for i, p in enumerate(items)]


def _per_prompt(value, n: int, name: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list with one entry per prompt, got {type(value).__name__}")
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts; give one per prompt")
    return list(value)


def _params(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = _per_prompt(sampling_params, n, "sampling_params")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise InvalidRequestError("invalid_sampling", f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
    return params


def _priorities(priority, n: int) -> list[int]:
    if priority is None:
        return [0] * n
    prios = _per_prompt(priority, n, "priority")
    for i, p in enumerate(prios):
        if not _is_token_id(p):  # numpy integers are integers; bools and floats are not
            raise InvalidRequestError("invalid_priority", f"priority[{i}] must be an integer, got {p!r}")
    return [int(p) for p in prios]


def _progress(use_tqdm: bool | Callable[..., Any], total: int):
    """vLLM's ``use_tqdm``: True shows a tqdm bar, a callable is the tqdm-like factory to use."""
    if use_tqdm is False or total == 0:
        return None
    if use_tqdm is True:
        from tqdm import tqdm

        return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
    return use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


def _check_progress(use_tqdm) -> None:
    if not isinstance(use_tqdm, bool) and not callable(use_tqdm):
        raise TypeError(f"use_tqdm must be a bool or a tqdm-like callable, got {type(use_tqdm).__name__}")


def _loras(lora_request, n: int) -> list[LoRARequest | None]:
    """vLLM's ``lora_request``: None (the base model), one ``LoRARequest`` for every prompt, or a
    list with one per prompt (None entries: the base model)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if isinstance(lora_request, (list, tuple)):
        return _per_prompt(lora_request, n, "lora_request")
    raise InvalidRequestError("invalid_lora", f"lora_request must be a LoRARequest, a list of them (one per prompt) or None, got {type(lora_request).__name__}")


class LLM:
    def __init__(self, model: str, **engine_config):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_config))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (vLLM's name)."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | dict | Seq[Prompt | dict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: Seq[int] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching; outputs in prompt order.
        Prompt forms: see the module docstring. ``priority``: one integer per prompt, lower first;
        anything but 0 needs ``scheduling_policy="priority"`` (the default). ``lora_request``: the
        LoRA adapter (``enable_lora=True``) for every prompt, or a list with one per prompt (None:
        the base model); each adapter is loaded and checked before anything runs."""
        _check_progress(use_tqdm)
        parsed = parse_prompts(prompts)
        return self._run([p for p, _ in parsed], [t for _, t in parsed], sampling_params, priority, use_tqdm, lora_request)

    def chat(
        self,
        messages: list[dict] | Seq[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of messages) or a list of them, each
        rendered with the chat template (or ``chat_template``) and generated from. A message's
        ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts (joined with
        newlines, as vLLM's "string" format); other part types are refused. ``RequestOutput.prompt``
        is the rendered text."""
        _check_progress(use_tqdm)
        if mm_processor_kwargs is not None:
            raise _invalid("mm_processor_kwargs: multi-modal input is not supported (text models only)")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise _invalid(f"chat_template_content_format must be 'auto', 'string' or 'openai', got {chat_template_content_format!r}")
        if isinstance(messages, (list, tuple)) and messages and all(isinstance(m, (list, tuple)) for m in messages):
            convs = [list(c) for c in messages]
        else:
            convs = [messages]
        kwargs: dict[str, Any] = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools is not None:
            kwargs["tools"] = tools
        kwargs.update(chat_template_kwargs or {})  # as vLLM: they come last and win
        if kwargs["add_generation_prompt"] and kwargs["continue_final_message"]:
            raise _invalid("continue_final_message needs add_generation_prompt=False")
        prompts, texts = [], []
        for i, conv in enumerate(convs):
            where = "messages" if len(convs) == 1 else f"messages[{i}]"
            msgs = _chat_messages(conv, where)
            try:
                text = self.tokenizer.apply_chat_template(msgs, tokenize=False, **kwargs)
                ids = self.tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False, **kwargs)
            except Exception as e:  # a template may reject role orders, unknown kwargs etc.
                raise _invalid(f"{where}: chat template failed: {e}") from e
            prompts.append(_token_ids(list(ids), f"{where} (rendered)"))
            texts.append(text)
        return self._run(prompts, texts, sampling_params, None, use_tqdm, lora_request)

    def _run(self, prompts: list[Prompt], texts: list[str | None], sampling_params, priority, use_tqdm,
             lora_request=None) -> list[RequestOutput]:
        """Checks everything, queues every prompt, steps until all are done; on any exception the
        requests queued here are aborted before it propagates (see the module docstring)."""
        n = len(prompts)
        params = _params(sampling_params, n)
        prios = _priorities(priority, n)
        if self.engine.config.scheduling_policy != "priority":
            bad = [i for i, p in enumerate(prios) if p != 0]
            if bad:
                raise InvalidRequestError("invalid_priority", f"priority[{bad[0]}] is {prios[bad[0]]}: a non-zero priority needs "
                                          f"scheduling_policy='priority' (this engine is {self.engine.config.scheduling_policy!r})")
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                tokens = self.engine.encode(prompt)
                self.engine.check(tokens, p)
            except InvalidRequestError as e:
                where = f"prompts[{i}]: " if n > 1 else ""
                raise InvalidRequestError(e.code, f"{where}{e}") from e
            ids.append(tokens)
        loras = _loras(lora_request, n)
        for i, lora in enumerate(loras):
            try:
                self.engine.check_lora(lora)
            except InvalidRequestError as e:
                raise InvalidRequestError(e.code, f"lora_request[{i}]: {e}" if isinstance(lora_request, (list, tuple)) else str(e)) from e
        by_id: dict[int, LoRARequest] = {}
        for i, lora in enumerate(loras):
            if lora is not None and by_id.setdefault(lora.lora_int_id, lora).lora_path != lora.lora_path:
                first = by_id[lora.lora_int_id]
                raise InvalidRequestError("invalid_lora", f"lora_request[{i}]: lora_int_id {lora.lora_int_id} names {lora.lora_path!r} here and "
                                          f"{first.lora_path!r} for {first.lora_name!r}; give each adapter folder its own id")
        for lora in by_id.values():
            self.engine.add_lora(lora)  # loads and validates now: a bad adapter fails the call before anything runs
        added: list[Request] = []
        bar = None
        try:
            for tokens, text, p, prio, lora in zip(ids, texts, params, prios, loras):
                req = self.engine.add_request(f"offline-{next(self._ids)}", tokens, p, prio, lora_request=lora)
                req.prompt = text
                added.append(req)
            bar = _progress(use_tqdm, n)
            ours = {r.request_id for r in added}
            while self.engine.has_unfinished():
                done = [r for r in self.engine.step() if r.finished and r.request_id in ours]
                if bar is not None and done:
                    bar.update(len(done))
        except BaseException:
            for req in added:
                if self.engine.requests.get(req.request_id) is req:
                    self.engine.abort(req.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final_output(r) for r in added]

    def stats(self) -> dict:
        return self.engine.stats()

    # -- LoRA adapters (vLLM's names) ---------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def lora_stats(self) -> dict:
        return self.engine.lora_stats()


def _chat_messages(conv: object, where: str) -> list[dict]:
    """A conversation with each message's content as a string (text parts joined)."""
    if not isinstance(conv, (list, tuple)) or not conv:
        raise _invalid(f"{where} must be a non-empty list of messages (dicts with 'role' and 'content')")
    out = []
    for j, m in enumerate(conv):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _invalid(f"{where}[{j}] must be a message: a dict with a string 'role' and 'content'")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise _invalid(f"{where}[{j}]: content part {kind!r} is not supported (text parts only)")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise _invalid(f"{where}[{j}]['content'] must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out
