"""The wire contract: pydantic v2 models for every message qworker reads or writes.

These models are the source of truth; ``schemas/*.json`` is generated from them by
``python -m qworker.schemas_gen`` and a test fails when the two disagree. All messages are
JSON (orjson) and keyed by the job id, so every event of one job lands on one partition in
order. ``SCHEMA_VERSION`` bumps on any incompatible change; it is part of each schema's file
name and ``$id``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, field_validator, model_validator

SCHEMA_VERSION = 1

# Bounds keep a hostile or buggy producer from asking for absurd work; the engine validates
# again (SamplingParams) and its verdict wins.
MAX_ID_LEN = 256
MAX_STOP = 16
MAX_N = 16
MAX_LOGPROBS = 20
INT64_MAX = 2**63 - 1
# Echoed metadata is bounded so that every answer stays serialisable (pydantic refuses to
# serialise past 255 levels) and small next to the message size limit.
MAX_METADATA_DEPTH = 32  # nested objects/arrays, the metadata object itself included
MAX_METADATA_BYTES = 64 * 1024  # as compact JSON

JobId = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN, description="Job id: the idempotency key and the Kafka key of every message about the job.")]


def _integral(v: Any) -> Any:
    """JSON has one kind of number: 4.0 is the integer 4 (JSON Schema's "integer" accepts it too),
    so a job's integer fields take it; "4", 4.5 and true stay refused (the models are strict)."""
    return int(v) if type(v) is float and v.is_integer() else v


JsonInt = Annotated[int, BeforeValidator(_integral)]
TokenId = Annotated[JsonInt, Field(ge=0, le=2**31 - 1)]
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit
# JSON object keys are strings: a token id in decimal, as OpenAI's logit_bias spells it
LogitBiasToken = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")]
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]
MIN_LOGPROB = -9999.0  # what vLLM's server writes for a token of probability 0 (JSON has no -inf)


def wire_logprob(value: float) -> float:
    """A logprob as the answers carry it: a finite number. A token a grammar masked is in a
    top-k list at -inf (orjson would write null, which no OpenAI type accepts)."""
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # NaN too


def check_metadata(value: Any) -> Any:
    """Raises ValueError when ``value`` nests deeper than ``MAX_METADATA_DEPTH`` containers or
    its JSON exceeds ``MAX_METADATA_BYTES``. Iterative: a hostile depth must not recurse."""
    if value is None:
        return value
    stack = [(value, 1)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, (dict, list)):
            if depth > MAX_METADATA_DEPTH:
                raise ValueError(f"metadata nests deeper than {MAX_METADATA_DEPTH} levels")
            stack.extend((y, depth + 1) for y in (x.values() if isinstance(x, dict) else x))
    size = len(_json(value))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {size} bytes of JSON, more than {MAX_METADATA_BYTES}")
    return value


def bounded_metadata(value: Any) -> dict[str, Any] | None:
    """``value`` when it is a dict within the metadata bounds, else None (for echoing the
    metadata of a job that failed validation)."""
    if not isinstance(value, dict):
        return None
    try:
        return check_metadata(value)
    except (ValueError, TypeError, RecursionError):
        return None


class _Strict(BaseModel):
    # strict: "5" is not an int and 1 is not a bool; extra fields are rejected so a typo such
    # as "max_token" fails loudly instead of silently using the default.
    model_config = ConfigDict(strict=True, extra="forbid")


class Sampling(_Strict):
    """Sampling parameters; names and meanings follow the engine's (vLLM's) ``SamplingParams``."""

    max_tokens: JsonInt = Field(16, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=100.0, allow_inf_nan=False, description="0 means greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: JsonInt = Field(0, ge=-1, le=1_000_000, description="0 or -1: off.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    seed: JsonInt | None = Field(None, ge=0, le=INT64_MAX)
    stop: list[Annotated[str, Field(min_length=1, max_length=1000)]] = Field(default_factory=list, max_length=MAX_STOP)
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=1000)
    ignore_eos: StrictBool = False
    min_tokens: JsonInt = Field(0, ge=0, le=1_000_000)
    logprobs: JsonInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top-N logprobs per generated token.")
    n: JsonInt = Field(1, ge=1, le=MAX_N)
    include_stop_str_in_output: StrictBool = Field(False, description="Keep a matched stop string, or the text of a stop token / EOS, in the text.")
    logit_bias: dict[LogitBiasToken, LogitBias] | None = Field(
        None, max_length=MAX_LOGIT_BIAS,
        description="OpenAI's logit_bias: {token id as a string: bias in [-100, 100]}, added to the logits before sampling "
        "(-100 in effect bans a token, 100 forces it).",
    )

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``qworker.engine.SamplingParams`` (logit_bias keyed by int, and
        only when set: a job without one asks the engine for nothing new)."""
        kw = self.model_dump()
        bias = kw.pop("logit_bias")
        if bias:
            kw["logit_bias"] = {int(tok): b for tok, b in bias.items()}
        return kw


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=1_000_000)


class Job(_Strict):
    """A generation job on the jobs topic (key = ``id``).

    Exactly one of ``prompt``, ``messages`` (rendered with the tokenizer's chat template) or
    ``prompt_token_ids`` is set. A job whose JSON parses and has a string ``id`` but breaks this
    schema gets an ``error`` message (code ``invalid_job``), also when it nests deeper than the
    decoder takes (then a copy goes to the DLQ topic too, code ``too_deep``); bytes that are not
    a JSON object with a string ``id`` cannot be answered and go to the DLQ topic.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    id: JobId
    model: str | None = Field(
        None, max_length=512,
        description="When set, must name the model this worker serves, or one of its LoRA adapters (OpenAI's way); else error "
        "'wrong_model' (a worker without LoRA) or 'model_not_found' (a worker serving adapters).",
    )
    lora: str | None = Field(
        None, min_length=1, max_length=256,
        description="The LoRA adapter to run under, by the name the worker's QWORKER_LORA_MODULES gives it (never a path); "
        "unset: the base model. A name this worker does not serve gets error 'model_not_found'.",
    )
    prompt: str | None = Field(None, max_length=4_000_000)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=10_000)
    prompt_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=1_000_000)
    sampling: Sampling = Field(default_factory=Sampling)
    response_format: dict[str, Any] | None = Field(
        None,
        description="Structured output, at most one form: {type: text} | {type: json_object} | "
        "{type: json_schema, json_schema: {name, schema, strict?, description?}} (OpenAI's shapes) | "
        "{type: regex, regex} | {type: choice, choice: [str]} | {type: grammar, grammar} (EBNF). "
        "A malformed, unsupported or uncompilable one gets error 'invalid_structured_output'.",
        json_schema_extra={"examples": [{"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}},
                                        {"type": "choice", "choice": ["positive", "negative"]}]},
    )
    stream: StrictBool = Field(False, description="Publish token deltas to the tokens topic.")
    priority: JsonInt = Field(0, ge=-(2**31), le=2**31 - 1, description="Lower runs first.")
    deadline: float | None = Field(
        None,
        ge=0,
        allow_inf_nan=False,
        description="Unix time in seconds after which the job is not worth starting; error 'deadline_exceeded'.",
    )
    metadata: dict[str, Any] | None = Field(
        None,
        description=f"Echoed back on the completion or error. At most {MAX_METADATA_DEPTH} levels of nested objects/arrays "
        f"and {MAX_METADATA_BYTES} bytes as compact JSON; else error 'invalid_job'.",
    )

    @field_validator("metadata", mode="before")
    @classmethod
    def _bounded_metadata(cls, v: Any) -> Any:
        return check_metadata(v)

    @model_validator(mode="after")
    def _one_prompt(self) -> Job:
        given = [k for k in ("prompt", "messages", "prompt_token_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of prompt, messages, prompt_token_ids is required, got {given or 'none'}")
        return self

    def prompt_input(self) -> str | list[int] | list[dict[str, str]]:
        if self.prompt is not None:
            return self.prompt
        if self.messages is not None:
            return [m.model_dump() for m in self.messages]
        assert self.prompt_token_ids is not None
        return list(self.prompt_token_ids)


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    job_id: str
    attempt: int = Field(
        0,
        description="Which run produced this: the worker's consumer-group generation when the run "
        "started. A rerun (after a crash or rebalance) has a higher attempt; drop events of lower ones.",
    )
    run_id: str = Field(
        "",
        description="Unique per run; a completion's run_id names the stream events that belong to it (a stream "
        "replayed after a delivery failure the broker may or may not have applied gets a fresh run_id).",
    )


class Delta(_Out):
    """Streamed tokens of one choice (tokens topic, key = job id), coalesced over a short interval.

    ``seq`` starts at 0 and increases by one per event of a run, across all its choices (an
    ``n > 1`` job's choices share one numbering; ``index`` says whose tokens an event holds).
    Readers take the events whose ``run_id`` matches the completion's, order them by ``seq`` and
    concatenate ``text`` per ``index``; the completion's ``last_seq`` says when they have all.
    """

    type: Literal["delta"] = "delta"
    index: int = 0
    seq: int = Field(description="0, 1, 2, ... per run, across all choices; the completion's last_seq is the last one.")
    text: str
    token_ids: list[int]


class Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    index: int
    text: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length", "cancelled"]
    logprobs: list[dict[str, float]] | None = Field(None, description="Per token: {token_id: logprob}, sampled token included.")


class Usage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(0, description="Prompt tokens served from the prefix cache.")


class Timings(BaseModel):
    """Seconds, measured from the job record's Kafka timestamp (when it was produced)."""

    model_config = ConfigDict(extra="forbid")

    queue_s: float | None = Field(None, description="Produced -> first scheduled on the engine.")
    ttft_s: float | None = Field(None, description="Produced -> first token.")
    total_s: float = Field(description="Produced -> finished.")
    num_preemptions: int = 0


class Completion(_Out):
    """The final result of a job (completions topic, key = job id).

    ``status`` is ``cancelled`` when a cancel request aborted the job; its choices then carry
    ``finish_reason`` ``cancelled`` and whatever text was generated before the abort.
    """

    type: Literal["completion"] = "completion"
    status: Literal["ok", "cancelled"] = "ok"
    model: str = ""
    choices: list[Choice]
    usage: Usage
    timings: Timings
    metadata: dict[str, Any] | None = None
    last_seq: int | None = Field(
        None,
        description="The seq of the last stream event of this run_id: a reader has the whole stream once it holds every seq "
        "from 0 to last_seq. None: no event belongs to this run (stream false, or nothing was streamed).",
    )


class ErrorInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    code: str = Field(
        description="invalid_job | invalid_prompt | invalid_sampling | prompt_too_long | deadline_exceeded | "
        "wrong_model | model_not_found | invalid_lora | result_too_large | internal_error | invalid_structured_output | engine_error (or another engine InvalidRequestError code)"
    )
    message: str
    retryable: bool = Field(description="True when resubmitting the same job may succeed.")


class JobError(_Out):
    """A job that failed (completions topic, key = job id): never silence."""

    type: Literal["error"] = "error"
    error: ErrorInfo
    metadata: dict[str, Any] | None = None


class Cancel(_Strict):
    """A cancel request (cancel topic): aborts the job on whichever pod holds it."""

    job_id: JobId
    reason: str | None = Field(None, max_length=1000)


# DLQ records keep the original key, value and headers byte for byte (null stays null); these
# headers, appended after the original ones, say why and where from. A header whose key is not
# UTF-8 cannot be produced again: such records (code bad_headers) carry the original headers in
# DLQ_HEADER_RAW_HEADERS instead (JSON list of [key, value] pairs, hex-encoded, null when null).
DLQ_HEADER_ERROR = "qworker.dlq.error"  # machine code: empty | not_json | not_object | no_id | bad_headers | too_deep | corrupt_batch
# too_deep: valid JSON nested deeper than the decoder takes; a copy, the job is also answered invalid_job
# corrupt_batch: a record batch whose CRC does not hold or whose bytes do not parse; the value is
# the batch as fetched, the key null
DLQ_HEADER_MESSAGE = "qworker.dlq.message"
DLQ_HEADER_TOPIC = "qworker.source.topic"
DLQ_HEADER_PARTITION = "qworker.source.partition"
DLQ_HEADER_OFFSET = "qworker.source.offset"
DLQ_HEADER_TIMESTAMP = "qworker.source.timestamp"
DLQ_HEADER_RAW_HEADERS = "qworker.source.raw_headers"

# One schema per message type (file name ``<name>.v<version>.json``).
MESSAGE_TYPES: dict[str, type[BaseModel]] = {
    "job": Job,
    "delta": Delta,
    "completion": Completion,
    "error": JobError,
    "cancel": Cancel,
}


def dumps(msg: BaseModel) -> bytes:
    """Serialise a message for the wire (compact JSON, None fields kept so readers see them).

    Echoed ``metadata`` may hold what orjson refuses (integers beyond 64 bits, lone surrogates);
    the stdlib encoder writes those as valid JSON instead of failing the job.
    """
    return _json(msg.model_dump(mode="json"))


def json_bytes(data: Any) -> bytes:
    """Compact JSON of plain data, as ``dumps`` writes messages (OpenAI-shaped answers use it)."""
    return _json(data)


def _json(data: Any) -> bytes:
    try:
        return orjson.dumps(data)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(data, ensure_ascii=True, separators=(",", ":")).encode()


DECODER_DEPTH = 1024  # how deep ``loads`` nests: orjson's limit; the stdlib fallback stops near the recursion limit


def loads(raw: bytes) -> Any:
    """Parse JSON; falls back to the stdlib for valid JSON orjson rejects (integers beyond 64 bits).
    Valid JSON nested deeper than ``DECODER_DEPTH`` raises: ``jsonscan`` reads it."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)
