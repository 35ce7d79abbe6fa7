"""What the engine hands back: vLLM-shaped ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

# finish reasons
STOP = "stop"  # EOS, a stop token id or a stop string
LENGTH = "length"  # max_tokens or the model's context
ABORT = "abort"  # aborted by the caller (cancel, shutdown, rebalance), or failed by the engine

# RequestOutput.error_code: why the engine (not the caller) ended a request with ABORT
ERR_DEADLINE = "deadline_exceeded"  # its deadline passed before it was first scheduled
ERR_ENGINE = "engine_error"  # a failed engine step that could not be retried for it
ERR_SHUTDOWN = "engine_shutdown"  # the engine shut down before the request finished (not a cancel)


@dataclass(slots=True)
class Logprob:
    """One token's entry in a logprobs dict, as vLLM's: its log-probability, its rank in the
    distribution (1 = the most likely; the sampled token's real rank even when it is outside the
    top N) and its text (the token decoded alone, special tokens kept; filled when the output is
    built)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One generated token's logprobs: {token_id: Logprob}, the sampled token always included.
TokenLogprobs = dict[int, Logprob]


class CallableBool(int):
    """A bool that can also be called: vLLM's ``CompletionOutput.finished()`` is a method, while
    code written against earlier qworker reads ``c.finished`` as a bool; both must keep working
    (a bound method would always be truthy). Compares equal to True/False."""

    def __call__(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return repr(bool(self))


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # the sum of the sampled tokens' logprobs; None unless logprobs were asked for (as vLLM). In a
    # streamed delta it is set on the choice's last delta only (the running sum is not kept).
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> CallableBool:
        """``c.finished`` and ``c.finished()`` both work (see ``CallableBool``)."""
        return CallableBool(self.finish_reason is not None)


# scheduling events a request can go through (RequestMetrics.events)
EV_PREEMPT_SWAP = "preempt_swap"  # preempted; its KV blocks were swapped out to CPU memory
EV_PREEMPT_RECOMPUTE = "preempt_recompute"  # preempted; its KV will be recomputed
EV_SWAP_IN = "swap_in"  # a swapped-out sequence's KV came back and it runs again


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life; None until reached.

    ``events`` is appended to by the engine thread only, as ``(time, EV_*, choice index)``; a
    reader on another thread may read ``events[:k]`` for any ``k`` it has seen.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    events: list[tuple[float, str, int]] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    """One request's output.

    From ``LLM.generate`` it is cumulative and final. From ``AsyncEngine.generate`` each yield is a
    delta: ``outputs`` holds only the choices that changed, with only their new text/tokens;
    ``finished`` is True on the last yield, when every choice has a finish reason.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine failed the request (finish_reason "abort")
    error_code: str | None = None  # machine-readable reason next to ``error``: ERR_DEADLINE, ERR_ENGINE or ERR_SHUTDOWN
    # vLLM's field; always None: ``SamplingParams.prompt_logprobs`` is refused at admission
    prompt_logprobs: list | None = None
    # vLLM's field: the LoRARequest the request ran under (None: the base model)
    lora_request: object | None = None
