"""Builds ``RequestOutput`` objects from request state: cumulative (offline) or deltas (streaming)."""

from __future__ import annotations

from qworker.engine.outputs import CompletionOutput, RequestOutput
from qworker.engine.sequence import Request, Sequence


def _visible_length(seq: Sequence) -> int:
    detok = seq.detokenizer
    return len(detok.text) if seq.finished else detok.stable_length()


def final_output(request: Request) -> RequestOutput:
    outs = [
        CompletionOutput(
            index=s.index,
            text=s.detokenizer.text,
            token_ids=s.output_token_ids,
            finish_reason=s.finish_reason,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
            stop_reason=s.stop_reason,
        )
        for s in sorted(request.seqs, key=lambda s: s.index)
    ]
    return _request_output(request, outs)


def delta_output(request: Request) -> RequestOutput | None:
    """The choices that changed since the last call, with only their new text and tokens; None
    when nothing changed. Text that may still turn into a stop string is held back."""
    outs = []
    for s in sorted(request.seqs, key=lambda s: s.index):
        visible = _visible_length(s)
        new_tokens = s.output_token_ids[s.num_emitted_tokens :]
        if s.finish_reported or (not new_tokens and visible <= s.num_emitted_chars and not s.finished):
            continue
        text = s.detokenizer.text[s.num_emitted_chars : visible] if visible > s.num_emitted_chars else ""
        logprobs = None
        if s.logprobs is not None:
            logprobs = s.logprobs[s.num_emitted_logprobs :]
            s.num_emitted_logprobs = len(s.logprobs)
        outs.append(CompletionOutput(s.index, text, new_tokens, s.finish_reason, logprobs, s.stop_reason))
        s.num_emitted_chars = max(visible, s.num_emitted_chars)
        s.num_emitted_tokens = s.num_output_tokens
        s.finish_reported = s.finished
    if not outs:
        return None
    return _request_output(request, outs)


def _request_output(request: Request, outs: list[CompletionOutput]) -> RequestOutput:
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=outs,
        finished=request.finished,
        num_cached_tokens=request.num_cached_tokens,
        metrics=request.metrics,
        error=request.error,
        error_code=request.error_code,
    )
