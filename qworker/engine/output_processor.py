"""Builds ``RequestOutput`` objects from request state: cumulative (offline) or deltas (streaming)."""

from __future__ import annotations

from qworker.engine.detokenizer import decoder_for
from qworker.engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from qworker.engine.sequence import Request, Sequence


def _visible_length(seq: Sequence) -> int:
    detok = seq.detokenizer
    return len(detok.text) if seq.finished else detok.stable_length()


def _with_tokens(seq: Sequence, entries: list[TokenLogprobs]) -> list[TokenLogprobs]:
    """``entries`` with each ``Logprob.decoded_token`` set (the token decoded alone, special
    tokens kept, as vLLM's); the sampler leaves them unset so only what is handed out pays."""
    decode = decoder_for(seq.detokenizer.tokenizer, False)
    for entry in entries:
        for tok, lp in entry.items():
            if lp.decoded_token is None:
                lp.decoded_token = decode([tok])
    return entries


def _cumulative(seq: Sequence) -> float | None:
    """The sum of the sampled tokens' logprobs (vLLM's ``cumulative_logprob``); None without logprobs."""
    if seq.logprobs is None:
        return None
    return sum(entry[tok].logprob for tok, entry in zip(seq.output_token_ids, seq.logprobs))


def final_output(request: Request) -> RequestOutput:
    outs = [
        CompletionOutput(
            index=s.index,
            text=s.detokenizer.text,
            token_ids=s.output_token_ids,
            finish_reason=s.finish_reason,
            logprobs=_with_tokens(s, list(s.logprobs)) if s.logprobs is not None else None,
            stop_reason=s.stop_reason,
            cumulative_logprob=_cumulative(s),
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
            logprobs = _with_tokens(s, s.logprobs[s.num_emitted_logprobs :])
            s.num_emitted_logprobs = len(s.logprobs)
        cumulative = _cumulative(s) if s.finished else None  # once, not a quadratic running sum
        outs.append(CompletionOutput(s.index, text, new_tokens, s.finish_reason, logprobs, s.stop_reason, cumulative))
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
        lora_request=request.lora_request,
    )
