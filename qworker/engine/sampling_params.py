"""Sampling parameters, validated once at the engine's door."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from qworker.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from qworker.engine.structured.spec import StructuredOutputsParams

MAX_N = 16
MAX_LOGPROBS = 20
# entries of a logit_bias dict (OpenAI's limit is 300; this bounds the per-step cost of one request)
MAX_LOGIT_BIAS = 1024
# |bias| is clamped to this when applied: far past any logit (so it still decides), and small
# enough that neither float32 (max ~3.4e38) nor the division by a temperature >= GREEDY_EPS after a
# repetition penalty <= 10 overflows to inf (an inf logit makes the row's probabilities NaN)
LOGIT_BIAS_LIMIT = 1e30
# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS): dividing logits by a denormal
# temperature overflows to inf/NaN.
GREEDY_EPS = 1e-5


_INT_FIELDS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


def _is_bool(v: object) -> bool:
    """A Python or numpy bool (numpy's is no ``int`` subclass, and must not pass as a number)."""
    return isinstance(v, bool) or getattr(getattr(v, "dtype", None), "kind", None) == "b"


def _is_integer(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not _is_bool(v)


@dataclass(slots=True)
class SamplingParams:
    """What to sample and when to stop; names and meanings follow vLLM's ``SamplingParams``.

    ``temperature < GREEDY_EPS`` (0 included) is greedy. ``seed`` makes a request's samples independent of the rest
    of the batch: the sampler draws from a per-request generator. ``n > 1`` forks the prompt into
    ``n`` sequences that share its KV blocks (copy-on-write); sample ``i`` uses seed ``seed + i``.

    As vLLM's: ``stop=None`` / ``stop_token_ids=None`` / ``logit_bias=None`` mean none;
    ``max_tokens=None`` means up to the model's context (the engine resolves it per request at
    admission: ``resolved``). ``logit_bias`` ({token id: bias}) is added to the logits before
    sampling (before penalties and temperature; the reported logprobs are the raw model's, as
    vLLM's default); its ids are checked against the vocabulary at admission, and a value's
    magnitude is capped at ``LOGIT_BIAS_LIMIT`` (1e30) when applied.
    Numbers may be numpy scalars (``np.int64``, ``np.float32``, ``np.bool_``): they are stored as
    Python ``int`` / ``float`` / ``bool``.
    ``prompt_logprobs`` exists for vLLM code but only None is accepted.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one)
    skip_special_tokens: bool = True
    # keep the matched stop string, or the text of a matched stop token id / EOS, in the text
    include_stop_str_in_output: bool = False
    # structured output (vLLM's name): JSON schema, JSON object, regex, choice or grammar.
    # The spec validates itself at construction; the engine compiles it (see qworker.engine.structured).
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None  # vLLM's; not supported: only None passes validate()
    # logit_bias as (ids, values, largest id) CPU tensors, built on first use by the sampler and
    # dropped by validate() (building them from the dict every step cost ~0.2 us per entry)
    _bias_tensors: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop, (list, tuple)) or not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidRequestError("invalid_sampling", "stop must be a string or a list of strings, and stop_token_ids a list of integers")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias)  # the caller's dict may change later; ours must not
            if not self.logit_bias:
                self.logit_bias = None
        self._plain_numbers()
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def _plain_numbers(self) -> None:
        """numpy (or other ``numbers``) scalars -> Python ``int`` / ``float`` / ``bool``, in place,
        so the checks see one kind of number and torch, seeds and JSON get plain ones. What is not
        a number of the field's kind is left as it is, for ``validate`` to refuse."""
        for name in _INT_FIELDS:
            v = getattr(self, name)
            if type(v) is not int and _is_integer(v):
                setattr(self, name, int(v))
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if type(v) not in (int, float) and isinstance(v, numbers.Real) and not _is_bool(v):
                setattr(self, name, float(v))
        for name in _BOOL_FIELDS:
            v = getattr(self, name)
            if type(v) is not bool and _is_bool(v):
                setattr(self, name, bool(v))
        if isinstance(self.stop_token_ids, list) and any(type(t) is not int for t in self.stop_token_ids):
            self.stop_token_ids = [int(t) if _is_integer(t) else t for t in self.stop_token_ids]
        bias = self.logit_bias
        if isinstance(bias, dict) and any(type(k) is not int or type(v) not in (int, float) for k, v in bias.items()):
            self.logit_bias = {(int(k) if _is_integer(k) else k): (float(v) if isinstance(v, numbers.Real) and not _is_bool(v) else v)
                               for k, v in bias.items()}

    def logit_bias_tensors(self) -> tuple | None:
        """``logit_bias`` as ``(ids int64, values float32, max id)``, or None without one."""
        bias = self.logit_bias
        if not bias:
            return None
        # read once into a local: validate() on another thread (AsyncEngine admits on the event
        # loop) may reset the cache between the check and the return
        cached = self._bias_tensors
        if cached is None:
            import torch

            ids = torch.tensor(list(bias.keys()), dtype=torch.long)
            values = torch.tensor(list(bias.values()), dtype=torch.float64).clamp_(-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
            cached = (ids, values.to(torch.float32), int(ids.max()))
            self._bias_tensors = cached
        return cached

    def resolved(self, room: int) -> SamplingParams:
        """A request's own copy of these parameters, with ``room`` tokens of context left after its
        prompt: ``max_tokens=None`` becomes ``room``. Always a copy (validated again, its lists and
        dict copied): the caller's object may serve other prompts, or be changed while the request
        runs, as vLLM's clone at admission allows."""
        return replace(self, max_tokens=room if self.max_tokens is None else self.max_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError("invalid_sampling", msg)

        self._bias_tensors = None  # the dict may have been replaced since they were built
        self._plain_numbers()  # fields may have been set since construction

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1 or None (up to the context), got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= (self.max_tokens if self.max_tokens is not None else self.min_tokens):
            raise bad(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_num(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_num(v) or not -2.0 <= v <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {v!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if not isinstance(self.stop, list) or not isinstance(self.stop_token_ids, list):
            raise bad("stop must be a list of strings and stop_token_ids a list of integers")
        if not all(isinstance(s, str) and s for s in self.stop) or len(self.stop) > 16:
            raise bad("stop must be at most 16 non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise bad(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.structured_outputs is not None:
            from qworker.engine.structured.spec import StructuredOutputError, StructuredOutputsParams

            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise StructuredOutputError("structured_outputs must be a StructuredOutputsParams")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None:
            raise bad(f"prompt_logprobs is not supported (only None), got {self.prompt_logprobs!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad(f"logit_bias must be a dict {{token id: bias}} or None, got {type(self.logit_bias).__name__}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise bad(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
            for tok, bias in self.logit_bias.items():
                if not is_int(tok) or tok < 0:
                    raise bad(f"logit_bias keys must be non-negative integer token ids, got {tok!r}")
                if not is_num(bias):
                    raise bad(f"logit_bias values must be finite numbers, got {bias!r} for token {tok}")
