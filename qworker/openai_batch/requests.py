"""OpenAI batch request lines -> native ``Job``s.

A line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` one of
``/v1/chat/completions`` or ``/v1/completions``. Invariants:

- ``custom_id`` becomes the job id, so dedupe and idempotency are the native ones.
- Every body field is either mapped or refused with a ``RequestError`` that names it; nothing is
  silently dropped. A field set to ``null`` counts as absent (it asks for nothing), as does an
  unsupported field set to its neutral value (``"echo": false``, ``"tools": []``, ...).
- Values are checked by the native ``Job`` model (one set of bounds for both formats); its
  errors are translated back to the OpenAI field names the line used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ValidationError

from qworker.job_ids import is_openai_line
from qworker.messages import MAX_LOGPROBS, Job

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
ENDPOINTS: dict[str, Literal["chat", "completions"]] = {CHAT_URL: "chat", COMPLETIONS_URL: "completions"}
LINE_FIELDS = ("custom_id", "method", "url", "body")

# Chat and completions share these; the sets below add each endpoint's own.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "frequency_penalty", "presence_penalty",
           "logprobs", "response_format", "stream", "stream_options", "user", "metadata", "logit_bias"}
# vLLM's sampling extensions, under vLLM's names (they map 1:1 onto native sampling fields).
EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output"}
CHAT_FIELDS = _COMMON | EXTENSIONS | {"messages", "max_completion_tokens", "top_logprobs"}
COMPLETIONS_FIELDS = _COMMON | EXTENSIONS | {"prompt"}

# Unsupported fields whose value asks for nothing; anything else in them is refused.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (False,), "best_of": (1,), "tools": ([],), "functions": ([],),
    "store": (False,), "service_tier": ("auto", "default"), "suffix": ("",), "modalities": (["text"],),
}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_MESSAGE_NEUTRAL = {"tool_calls": ([],), "refusal": (None,), "function_call": (None,)}
# Chat's default: no cap, as OpenAI's (the model's context ends the output). The native bound.
UNCAPPED = 1_000_000
MAX_METADATA_KEYS = 16


class RequestError(Exception):
    """A line that cannot run. ``param`` names the offending field as the line spelled it
    (``body.max_tokens``, ``body.messages[2].content``, ``url``)."""

    def __init__(self, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def _unsupported(param: str, what: str = "is not supported by qworker") -> RequestError:
    return RequestError("unsupported_parameter", f"{param} {what}", param)


def _invalid(param: str, message: str) -> RequestError:
    return RequestError("invalid_job", f"{param}: {message}", param)


@dataclass(slots=True, frozen=True)
class OpenAIRequest:
    """What answering a line in OpenAI's shape needs beyond the native result.

    ``logprobs``: how many alternatives per token to report (chat: ``top_logprobs`` when
    ``logprobs`` is true; completions: ``logprobs``), None when none were asked for.
    ``created``: Unix seconds when the worker read the line, the ``created`` of every object
    answering it. ``metadata``: echoed in a chat completion's body (OpenAI's field)."""

    custom_id: str
    endpoint: Literal["chat", "completions"] = "chat"
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    created: int = 0
    metadata: dict[str, str] | None = None


def looks_like_openai_line(data: object) -> bool:
    """An object shaped as an OpenAI request line but perhaps without its ``custom_id``: no
    native ``id``, and the line fields ``url`` and ``body`` (native jobs have neither)."""
    return is_openai_line(data) or (isinstance(data, dict) and "id" not in data and {"url", "body"} <= data.keys())


def map_line(data: dict[str, Any], now: float | None = None) -> tuple[Job, OpenAIRequest]:
    """The native job for a request line whose ``custom_id`` is already known usable; raises
    ``RequestError`` naming the first field that cannot be served."""
    extra = [k for k in data if k not in LINE_FIELDS]
    if extra:
        raise _unsupported(extra[0], "is not a field of a batch request line (custom_id, method, url, body)")
    if data.get("method") != "POST":
        raise _invalid("method", f"must be \"POST\", got {data.get('method')!r}")
    url = data.get("url")
    endpoint = ENDPOINTS.get(url) if isinstance(url, str) else None
    if endpoint is None:
        raise RequestError("invalid_job", f"url: must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}", "url")
    body = data.get("body")
    if not isinstance(body, dict):
        raise _invalid("body", f"must be an object, got {type(body).__name__}")
    body = {k: v for k, v in body.items() if v is not None}
    allowed = CHAT_FIELDS if endpoint == "chat" else COMPLETIONS_FIELDS
    for k, v in body.items():
        if k not in allowed and not (k in NEUTRAL and any(v == n and type(v) is type(n) for n in NEUTRAL[k])):
            other = COMPLETIONS_URL if endpoint == "chat" else CHAT_URL
            hint = f" (only on {other})" if k in (CHAT_FIELDS | COMPLETIONS_FIELDS) else ""
            raise _unsupported(f"body.{k}", f"is not supported on {url}{hint}")
    names: dict[str, str] = {}  # native loc -> the body field it came from, for error messages
    job: dict[str, Any] = {"id": data["custom_id"]}
    sampling: dict[str, Any] = {}

    def put(native: str, field: str, value: Any) -> None:
        sampling[native] = value
        names[f"sampling.{native}"] = f"body.{field}"

    # logit_bias: {token id as a string: -100..100}, OpenAI's and the native shape alike
    for f in ("temperature", "top_p", "n", "seed", "frequency_penalty", "presence_penalty", "logit_bias", *sorted(EXTENSIONS)):
        if f in body:
            put(f, f, body[f])
    if "stop" in body:
        stop = body["stop"]
        put("stop", "stop", [stop] if isinstance(stop, str) else stop)
    _max_tokens(body, endpoint, put)
    logprobs = _logprobs(body, endpoint, put)
    if endpoint == "chat":
        if "messages" not in body:
            raise _invalid("body.messages", "is required")
        job["messages"] = _messages(body["messages"])
        names["messages"] = "body.messages"
    else:
        if "prompt" not in body:
            raise _invalid("body.prompt", "is required")
        key, value = _prompt(body["prompt"])
        job[key] = value
        names[key] = "body.prompt"
    stream, include_usage = _stream(body)
    job["stream"] = stream
    names["stream"] = "body.stream"
    for f in ("model", "response_format"):
        if f in body:
            job[f] = body[f]
            names[f] = f"body.{f}"
    metadata = _metadata(body.get("metadata"))
    if metadata is not None:
        job["metadata"] = metadata
    if "user" in body and not isinstance(body["user"], str):
        raise _invalid("body.user", "must be a string")  # accepted, used for nothing
    job["sampling"] = sampling
    try:
        native = Job.model_validate(job)
    except ValidationError as e:
        raise _translate(e, names) from None
    created = int(time.time() if now is None else now)
    return native, OpenAIRequest(data["custom_id"], endpoint, logprobs, stream, include_usage, created, metadata if endpoint == "chat" else None)


def _max_tokens(body: dict, endpoint: str, put) -> None:
    given = [f for f in ("max_completion_tokens", "max_tokens") if f in body]
    if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
        raise _invalid("body.max_tokens", "max_tokens and max_completion_tokens differ; set one")
    if given:
        put("max_tokens", given[0], body[given[0]])
    elif endpoint == "chat":
        put("max_tokens", "max_completion_tokens", UNCAPPED)
    else:
        put("max_tokens", "max_tokens", 16)  # OpenAI's default for /v1/completions


def _logprobs(body: dict, endpoint: str, put) -> int | None:
    """Chat: ``logprobs`` is a bool and ``top_logprobs`` (0-20) needs it true. Completions:
    ``logprobs`` is the number of alternatives (OpenAI allows 0-5; qworker up to 20)."""
    lp = body.get("logprobs")
    if endpoint == "completions":
        if lp is None:
            return None
        if not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS:
            raise _invalid("body.logprobs", f"must be an integer in [0, {MAX_LOGPROBS}] on /v1/completions, got {lp!r}")
        put("logprobs", "logprobs", lp)
        return lp
    top = body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise _invalid("body.logprobs", f"must be a boolean on /v1/chat/completions (use top_logprobs for the count), got {lp!r}")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool) or not 0 <= top <= MAX_LOGPROBS:
            raise _invalid("body.top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
        if not lp:
            raise _invalid("body.top_logprobs", "needs logprobs: true")
    if not lp:
        return None
    n = top or 0
    put("logprobs", "top_logprobs", n)
    return n


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise _invalid("body.messages", "must be a non-empty array of messages")
    out = []
    for i, m in enumerate(value):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise _invalid(where, "must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:  # (a list or object is unhashable)
            if role in ("tool", "function"):
                raise _unsupported(f"{where}.role", f"{role!r} is not supported by qworker (no tool calling)")
            raise _invalid(f"{where}.role", f"must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        for k, v in m.items():
            if k not in ("role", "content") and not (k in _MESSAGE_NEUTRAL and v in _MESSAGE_NEUTRAL[k]):
                raise _unsupported(f"{where}.{k}")
        out.append({"role": CHAT_ROLES[role], "content": _content(m.get("content"), f"{where}.content")})
    return out


def _content(value: Any, where: str) -> str:
    """A string, or an array of text parts (joined with newlines, as vLLM does)."""
    if isinstance(value, str):
        return value
    if value is None:
        raise _invalid(where, "is required")
    if not isinstance(value, list):
        raise _invalid(where, f"must be a string or an array of text parts, got {type(value).__name__}")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict):
            raise _invalid(f"{where}[{j}]", "must be an object")
        if part.get("type") != "text":
            raise _unsupported(f"{where}[{j}].type", f"{part.get('type')!r} is not supported by qworker (text only)")
        extra = [k for k in part if k not in ("type", "text")]
        if extra:
            raise _unsupported(f"{where}[{j}].{extra[0]}")
        if not isinstance(part.get("text"), str):
            raise _invalid(f"{where}[{j}].text", "must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompt(value: Any) -> tuple[str, Any]:
    """A string or token ids, alone or as the one element of a list; several prompts in one
    line are refused (OpenAI would answer each as its own choices; send one line each)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return "prompt", value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return "prompt_token_ids", value
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise _unsupported("body.prompt", "with several prompts is not supported by qworker (one prompt per line)")
    raise _invalid("body.prompt", "must be a string, an array of token ids, or an array holding one of them")


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("body.stream", f"must be a boolean, got {stream!r}")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise _invalid("body.stream_options", "is only allowed when stream is true")
    if not isinstance(opts, dict):
        raise _invalid("body.stream_options", "must be an object")
    for k, v in opts.items():
        if k == "include_usage":
            if not isinstance(v, bool):
                raise _invalid("body.stream_options.include_usage", "must be a boolean")
        elif not (k == "include_obfuscation" and v is False):
            raise _unsupported(f"body.stream_options.{k}")
    return stream, bool(opts.get("include_usage", False))


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's rule: at most 16 pairs, string keys up to 64 characters, string values up to 512."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid("body.metadata", "must be an object of strings")
    if len(value) > MAX_METADATA_KEYS:
        raise _invalid("body.metadata", f"has {len(value)} keys; at most {MAX_METADATA_KEYS}")
    for k, v in value.items():
        if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
            raise _invalid(f"body.metadata.{k[:64]}", "keys are at most 64 characters, values strings of at most 512")
    return value


def _translate(err: ValidationError, names: dict[str, str]) -> RequestError:
    """The native model's complaint, told in the line's own field names."""
    parts, first = [], None
    for e in err.errors(include_url=False, include_input=False):
        raw = [x for x in e["loc"] if x != "[key]"]  # a dict key's complaint names the key itself
        loc = [str(x) for x in raw]
        param = None
        for cut in range(len(loc), 0, -1):  # the longest native prefix we know a body name for
            head = ".".join(loc[:cut])
            if head in names:
                # list positions are ints, object keys strings (logit_bias's "13" is a key)
                param = names[head] + "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in raw[cut:])
                break
        param = param or ("body" if not loc else "body." + ".".join(loc))
        first = first or param
        parts.append(f"{param}: {e['msg'].removeprefix('Value error, ')}")
    text = "; ".join(parts)
    return RequestError("invalid_job", text if len(text) <= 2000 else text[:1997] + "...", first)
