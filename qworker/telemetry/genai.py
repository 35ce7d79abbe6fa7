"""GenAI semantic-convention attributes and the ``generate`` span's events.

Attribute names follow the current GenAI conventions (``gen_ai.request.*``, ``gen_ai.response.*``,
``gen_ai.usage.*``); the deprecated ``gen_ai.system`` and ``gen_ai.usage.prompt_tokens`` /
``completion_tokens`` are never written. Engine facts the conventions have no name for live under
``qworker.*``.

Every builder here is called only for a recording span: the no-op path never pays for dicts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode

from qworker.engine import outputs as engine

CHAT = "chat"
TEXT_COMPLETION = "text_completion"

# event names on the generate span
EV_FIRST_TOKEN = "first_token"
EV_PREEMPTION = "preemption"
EV_SWAP_OUT = "swap_out"
EV_SWAP_IN = "swap_in"
EV_ABORT = "abort"


def operation_name(prompt: object) -> str:
    """``chat`` for a list of role/content messages, else ``text_completion`` (a string or
    token ids)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], Mapping):
        return CHAT
    return TEXT_COMPLETION


def _get(sampling: Mapping[str, Any] | object, name: str) -> Any:
    if isinstance(sampling, Mapping):
        return sampling.get(name)
    return getattr(sampling, name, None)


def request_attributes(operation: str, model: str, sampling: Mapping[str, Any] | object, *, stream: bool | None = None) -> dict[str, Any]:
    """``gen_ai.request.*`` from sampling parameters (a dict such as ``Sampling.model_dump()``
    or an object with the same attribute names, such as the engine's ``SamplingParams``)."""
    attrs: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.request.model": model}
    for key, name in (
        ("max_tokens", "gen_ai.request.max_tokens"),
        ("temperature", "gen_ai.request.temperature"),
        ("top_p", "gen_ai.request.top_p"),
        ("top_k", "gen_ai.request.top_k"),
        ("seed", "gen_ai.request.seed"),
        ("presence_penalty", "gen_ai.request.presence_penalty"),
        ("frequency_penalty", "gen_ai.request.frequency_penalty"),
    ):
        value = _get(sampling, key)
        if value is not None:
            attrs[name] = value
    if attrs.get("gen_ai.request.top_k", 1) <= 0:  # 0 / -1 mean "off" in the engine
        del attrs["gen_ai.request.top_k"]
    n = _get(sampling, "n")
    if n is not None and n != 1:  # the convention: set only when it is not 1
        attrs["gen_ai.request.choice.count"] = n
    stop = _get(sampling, "stop")
    if stop:
        attrs["gen_ai.request.stop_sequences"] = list(stop)
    if stream is not None:
        attrs["gen_ai.request.stream"] = stream
    return attrs


def response_attributes(
    *,
    finish_reasons: Iterable[str],
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int = 0,
    response_model: str | None = None,
    response_id: str | None = None,
    time_to_first_chunk: float | None = None,
    queue_time: float | None = None,
    num_preemptions: int = 0,
) -> dict[str, Any]:
    """``gen_ai.response.*`` and ``gen_ai.usage.*``; times in seconds. Cached tokens are part of
    the input tokens, as the convention asks."""
    attrs: dict[str, Any] = {
        "gen_ai.response.finish_reasons": [r for r in finish_reasons if r],
        "gen_ai.usage.input_tokens": input_tokens,
        "gen_ai.usage.output_tokens": output_tokens,
        "gen_ai.usage.cache_read.input_tokens": cached_tokens,
        "qworker.preemptions": num_preemptions,
    }
    if response_model:
        attrs["gen_ai.response.model"] = response_model
    if response_id:
        attrs["gen_ai.response.id"] = response_id
    if time_to_first_chunk is not None:
        attrs["gen_ai.response.time_to_first_chunk"] = time_to_first_chunk
    if queue_time is not None:
        attrs["qworker.queue_time"] = queue_time
    return attrs


def _ns(t: float | None) -> int | None:
    return None if t is None else int(t * 1e9)


class GenerationTrace:
    """Events and final attributes of one ``generate`` span, fed from the engine's deltas.

    Invariant: the span is ended exactly once, by ``finish`` or ``fail``; later calls are no-ops,
    so the worker can call ``fail`` from a ``finally`` without checking.
    Preemption and swap events are the engine's own record (``RequestMetrics.events``, appended by
    the engine thread), replayed with their timestamps: each delta (and ``finish``) turns the
    entries not seen yet into span events. A preempted request emits nothing, so its events show
    on its next delta.
    """

    __slots__ = ("span", "recording", "_first_token", "_preemptions", "_events_seen", "_ended")

    def __init__(self, span: Span):
        self.span = span
        self.recording = span.is_recording()
        self._first_token = False
        self._preemptions = 0
        self._events_seen = 0
        self._ended = False

    def set_attributes(self, attrs: dict[str, Any]) -> None:
        if self.recording and not self._ended:
            self.span.set_attributes(attrs)

    def on_output(self, out: Any) -> None:
        """Call with each ``RequestOutput`` delta."""
        if not self.recording:
            return
        m = out.metrics
        if not self._first_token and any(c.token_ids for c in out.outputs):
            self._first_token = True
            self.span.add_event(EV_FIRST_TOKEN, timestamp=_ns(m.first_token_time) if m else None)
        if m is not None:
            self._scheduling_events(m)

    def _scheduling_events(self, m: Any) -> None:
        # the engine thread only appends: the first len() entries are complete and stay as they are
        n = len(m.events)
        for t, kind, index in m.events[self._events_seen : n]:
            attrs: dict[str, Any] = {"qworker.choice.index": index}
            if kind == engine.EV_PREEMPT_SWAP or kind == engine.EV_PREEMPT_RECOMPUTE:
                self._preemptions += 1
                mode = "swap" if kind == engine.EV_PREEMPT_SWAP else "recompute"
                self.span.add_event(EV_PREEMPTION, {**attrs, "qworker.preemption.mode": mode, "qworker.preemption.count": self._preemptions}, timestamp=_ns(t))
                if mode == "swap":
                    self.span.add_event(EV_SWAP_OUT, attrs, timestamp=_ns(t))
            elif kind == engine.EV_SWAP_IN:
                self.span.add_event(EV_SWAP_IN, attrs, timestamp=_ns(t))
        self._events_seen = n

    def finish(self, final: Any | None = None, *, end_time: float | None = None, **response: Any) -> None:
        """Sets ``response_attributes(**response)`` and ends the span. ``final`` (the last
        ``RequestOutput``) supplies the time to first chunk, queue time, preemption count and
        the scheduling events recorded after the last delta."""
        if self._ended:
            return
        self._ended = True
        if self.recording:
            m = getattr(final, "metrics", None)
            if m is not None:
                self._scheduling_events(m)
                if m.first_token_time is not None:
                    response.setdefault("time_to_first_chunk", max(0.0, m.first_token_time - m.arrival_time))
                if m.first_scheduled_time is not None:
                    response.setdefault("queue_time", max(0.0, m.first_scheduled_time - m.arrival_time))
                response.setdefault("num_preemptions", m.num_preemptions)
            self.span.set_attributes(response_attributes(**response))
        self.span.end(end_time=_ns(end_time))

    def abort(self, reason: str) -> None:
        """The request was aborted (cancel, shutdown, rebalance): an event, then ``finish``."""
        if self.recording and not self._ended:
            self.span.add_event(EV_ABORT, {"qworker.abort.reason": reason})

    def error(self, code: str) -> None:
        """The run ended with an error answer (``code``, e.g. "engine_error"): the span, ended
        by ``finish`` with what was generated, carries it as its status and ``error.type``."""
        if self.recording and not self._ended:
            self.span.set_attribute("error.type", code)
            self.span.set_status(Status(StatusCode.ERROR, code))

    def fail(self, error: BaseException | str) -> None:
        """Ends the span as an error (no-op once ended)."""
        if self._ended:
            return
        if self.recording:
            if isinstance(error, BaseException):
                self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, str(error)))
        self._ended = True
        self.span.end()
