"""Request bookkeeping: which requests are in flight, and how one enters and leaves.

``RequestBook`` owns ``requests`` (request id -> ``Request``, exactly the unfinished ones), the
min-heap of deadlines and the arrival counter. It validates and encodes what a caller submits
(``encode``, ``check``, ``add``), builds each choice's ``Sequence``, and ends requests: an abort,
an expired deadline, a failed step, or a generated token that stops a choice (``append``, with
vLLM's stop rules). A request leaves ``requests`` before (or as) it is ended, and every ended
choice leaves the scheduler through ``finish``: the only place a sequence becomes FINISHED.
Nothing here reads a clock: the engine passes ``now``, so every timestamp of a request comes
from one clock (the one tests move past a deadline).
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
from pathlib import Path

import torch

from qworker.engine.config import EngineConfig
from qworker.engine.detokenizer import IncrementalDetokenizer
from qworker.engine.lora_manager import prefix_root
from qworker.engine.lora_request import LoRARequest
from qworker.engine.outputs import ABORT, ERR_DEADLINE, ERR_ENGINE, LENGTH, STOP, RequestMetrics
from qworker.engine.sampling_params import InvalidRequestError, SamplingParams
from qworker.engine.scheduler import Scheduler
from qworker.engine.sequence import Request, SeqStatus, Sequence
from qworker.engine.structured.spec import ERROR_CODE as STRUCTURED_ERROR

log = logging.getLogger(__name__)

Prompt = str | list[int] | list[dict]


def eos_token_ids(tokenizer, model: str, vocab_size: int) -> set[int]:
    """The ids that end a choice: the tokenizer's EOS and the model's, as transformers' generate
    reads it: ``generation_config.json``'s ``eos_token_id`` (an id or a list), or config.json's
    where the folder has no generation config. A malformed generation config, or an id outside the
    vocabulary, is refused in one line naming the file (a string id would otherwise fail deep in the
    structured-output set-up, and an id no row of the LM head produces would never end a job)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    folder = Path(model)
    if not folder.is_dir():
        return ids
    path = folder / "generation_config.json"
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: not a JSON object")
        eos = raw.get("eos_token_id")
    else:
        from transformers import AutoConfig, GenerationConfig

        path = folder / "config.json"
        eos = GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder)).eos_token_id
    for e in eos if isinstance(eos, list) else [] if eos is None else [eos]:
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < vocab_size:
            raise ValueError(f"{path}: eos_token_id {e!r} is not a token id of the model (0..{vocab_size - 1})")
        ids.add(e)
    return ids


class RequestBook:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, tokenizer, vocab_size: int, max_model_len: int,
                 eos_token_ids: set[int], generator_device: torch.device, counters: dict[str, int]):
        self.config = config
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.detok_tokenizer = tokenizer  # see LLMEngine.thread_safe_tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.generator_device = generator_device
        self.counters = counters  # the engine's counters (shared, not copied)
        self.requests: dict[str, Request] = {}
        self.deadlines: list[tuple[float, int, Request]] = []  # min-heap of requests with a deadline
        self._arrivals = itertools.count()

    # -- in --------------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a string, token ids, or chat messages (the chat template)."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("empty_prompt", "the prompt is empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError("empty_prompt" if isinstance(prompt, list) else "invalid_prompt", "the prompt must be a non-empty string, token id list or message list")
        if all(isinstance(m, dict) for m in prompt):
            for m in prompt:
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise InvalidRequestError("invalid_prompt", "each chat message needs string 'role' and 'content'")
            try:
                ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
            except Exception as e:  # a template may reject role orders etc.
                raise InvalidRequestError("invalid_prompt", f"chat template failed: {e}") from e
            return list(ids)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError("invalid_prompt", f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
            return list(prompt)
        raise InvalidRequestError("invalid_prompt", "the prompt must be a string, a list of token ids or a list of chat messages")

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("empty_prompt", "the prompt is empty")
        limit = self.max_model_len - 1
        if not self.config.enable_chunked_prefill:  # the whole prompt must fit in one step
            limit = min(limit, self.config.max_num_batched_tokens)
        if len(prompt_token_ids) > limit:
            raise InvalidRequestError(
                "prompt_too_long",
                f"the prompt has {len(prompt_token_ids)} tokens; at most {limit} fit (context {self.max_model_len})",
            )
        params.validate()
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError("invalid_sampling", f"stop_token_ids out of range [0, {self.vocab_size}): {bad[:5]}")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError("invalid_sampling", f"logit_bias token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        room = self.max_model_len - len(prompt_token_ids)
        if params.max_tokens is None and params.min_tokens > room:
            raise InvalidRequestError("invalid_sampling", f"min_tokens {params.min_tokens} exceeds the {room} tokens of context left after the prompt")

    def make(self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int, deadline: float | None,
             now: float, lora_request: LoRARequest | None = None) -> Request:
        """Validates and encodes a request and builds it with its first sequence; nothing is
        recorded until ``record`` (a structured-output compile and an adapter load are submitted
        in between). ``lora_request``: checked by the caller (``LoRAManager.check``)."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("invalid_sampling", "params must be a SamplingParams")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequestError("invalid_priority", "priority must be an integer")
        if priority != 0 and self.config.scheduling_policy != "priority":
            # as vLLM: a priority the scheduler would ignore is a caller's mistake, not a no-op
            raise InvalidRequestError("invalid_priority", f"priority {priority} needs scheduling_policy='priority' (this engine is {self.config.scheduling_policy!r})")
        if deadline is not None and (not isinstance(deadline, (int, float)) or isinstance(deadline, bool) or deadline != deadline):
            raise InvalidRequestError("invalid_deadline", "deadline must be a number (Unix time) or None")
        ids = self.encode(prompt)
        self.check(ids, params)
        params = params.resolved(self.max_model_len - len(ids))  # max_tokens=None: up to the context
        order = next(self._arrivals)
        req = Request(
            request_id=request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=ids,
            params=params,
            priority=priority,
            arrival_order=order,
            metrics=RequestMetrics(arrival_time=now),
            sort_key=(priority if self.config.scheduling_policy == "priority" else 0, order),
            deadline=deadline,
            lora_request=lora_request,
            prefix_root=prefix_root(lora_request),
        )
        req.seqs.append(self.new_seq(req, 0))
        return req

    def record(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if req.deadline is not None:
            heapq.heappush(self.deadlines, (req.deadline, req.arrival_order, req))

    def new_seq(self, req: Request, index: int) -> Sequence:
        p = req.params
        seq = Sequence(request=req, index=index, token_ids=list(req.prompt_token_ids), num_prompt_tokens=len(req.prompt_token_ids))
        if p.seed is not None:
            seq.generator = torch.Generator(device=self.generator_device)
            seq.generator.manual_seed(p.seed + index)
        seq.logprobs = [] if p.logprobs is not None else None
        seq.detokenizer = IncrementalDetokenizer(self.detok_tokenizer, req.prompt_token_ids, p.stop, p.skip_special_tokens, p.include_stop_str_in_output)
        return seq

    # -- out -------------------------------------------------------------------------------------
    def abort(self, request_id: str, error: str | None, error_code: str | None, now: float) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.end(req, error, error_code, now)
        self.counters["requests_aborted"] += 1
        return req

    def fail(self, req: Request, exc: Exception, now: float) -> None:
        """Ends ``req`` alone with "engine_error" after recording its tokens raised (a state no
        check at admission caught): the rest of the step's requests go on."""
        log.error("request %s: recording its tokens failed", req.request_id, exc_info=exc)
        if self.requests.pop(req.request_id, None) is not None:
            self.end(req, f"recording the request's tokens failed: {exc!r}", ERR_ENGINE, now)
            self.counters["requests_failed"] += 1

    def end(self, req: Request, error: str | None, error_code: str | None, now: float) -> None:
        """Finishes every unfinished choice of ``req`` with ABORT (the caller has taken it out of
        ``requests``)."""
        req.error = error
        req.error_code = error_code
        for seq in req.seqs:
            if not seq.finished:
                self.finish(seq, ABORT)
        req.metrics.finished_time = now

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        # its blocks go back first: a tokenizer that fails on the last piece must not leak them
        self.scheduler.remove(seq)
        seq.status = SeqStatus.FINISHED
        try:
            seq.detokenizer.flush()
        except Exception:  # noqa: BLE001 - the text stays what was decoded so far
            log.exception("request %s: detokenizing its last piece failed", seq.request.request_id)

    def expire(self, now: float) -> list[Request]:
        """Finishes the requests whose deadline has passed (``now``, the engine's clock) before
        they were ever scheduled."""
        expired = []
        if len(self.deadlines) > 2 * len(self.requests) + 64:
            # entries of requests that started or ended stay until their deadline: drop them now
            # and then, so generous deadlines cannot keep finished requests alive
            self.deadlines = [e for e in self.deadlines if not e[2].admitted and self.requests.get(e[2].request_id) is e[2]]
            heapq.heapify(self.deadlines)
        while self.deadlines and self.deadlines[0][0] < now:
            _, _, req = heapq.heappop(self.deadlines)
            if req.admitted or self.requests.get(req.request_id) is not req:
                continue  # started (it runs to completion), finished or aborted
            del self.requests[req.request_id]
            self.end(req, f"the deadline passed {now - req.deadline:.3f}s before the request could start", ERR_DEADLINE, now)
            self.counters["requests_expired"] += 1
            expired.append(req)
        return expired

    def seconds_to_deadline(self, now: float, cap: float) -> float:
        """Time until the next deadline is due, at most ``cap`` (``cap`` when none is set)."""
        if not self.deadlines:
            return cap
        return min(cap, max(0.0, self.deadlines[0][0] - now))

    # -- a generated token -----------------------------------------------------------------------
    def append(self, seq: Sequence, token: int, lp, now: float) -> bool:
        """Appends one generated token with everything that follows from it; True if ``seq``
        finished (a stop, the length, or a token its grammar refuses)."""
        req = seq.request
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(lp)
        self.counters["generation_tokens"] += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
            self.counters["prompt_tokens_cached"] += req.num_cached_tokens
        if seq.structured is not None and not seq.structured.accept(token):
            # cannot happen after the mask; a guard so a refused token never continues
            log.error("request %s: sampled token %d does not fit its grammar", req.request_id, token)
            seq.detokenizer.append(token, find_stop=False)
            # the grammar, not the moment, is at fault: an error a retry would only repeat
            req.error = req.error or f"sampled token {token} does not fit the request's grammar (it may admit no output)"
            req.error_code = req.error_code or STRUCTURED_ERROR
            self.finish(seq, ABORT)
            return True
        reason = self._stop(seq, token)
        if reason is not None:
            self.finish(seq, *reason)
            return True
        return False

    def _stop(self, seq: Sequence, token: int) -> tuple[str, str | int | None] | None:
        """Feeds ``token`` to the detokenizer and decides whether ``seq`` stops (vLLM's order and
        rules: nothing but the length stops it before ``min_tokens``; the text of a stop token id
        or EOS is left out unless ``include_stop_str_in_output``)."""
        p = seq.request.params
        if seq.structured is not None and seq.structured.is_terminated():
            # the grammar is complete and took its stop token (EOS): that ends it, whatever
            # ignore_eos or min_tokens say (the mask allowed nothing else)
            if p.include_stop_str_in_output:
                seq.detokenizer.append(token, find_stop=False)
            return STOP, (token if token in p.stop_token_ids else None)
        past_min = seq.num_output_tokens >= p.min_tokens
        if past_min and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            if p.include_stop_str_in_output:
                seq.detokenizer.append(token, find_stop=False)
            return STOP, (token if token in p.stop_token_ids else None)
        stop_str = seq.detokenizer.append(token, find_stop=past_min)
        if stop_str is not None:
            return STOP, stop_str
        if seq.num_output_tokens >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return LENGTH, None
        return None
