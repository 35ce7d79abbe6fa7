"""Offline batch API, named like vLLM's: ``LLM(model_dir).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from qworker.engine.config import EngineConfig
from qworker.engine.llm_engine import LLMEngine, Prompt
from qworker.engine.output_processor import final_output
from qworker.engine.outputs import RequestOutput
from qworker.engine.sampling_params import SamplingParams


def _is_single_prompt(prompts) -> bool:
    if isinstance(prompts, str):
        return True
    if isinstance(prompts, list) and prompts and all(isinstance(p, (int, dict)) for p in prompts):
        return True  # token ids or one chat
    return False


class LLM:
    def __init__(self, model: str, **engine_config):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_config))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion with continuous batching; outputs in prompt order.
        A prompt is a string, a list of token ids, or a list of chat messages."""
        prompt_list = [prompts] if _is_single_prompt(prompts) else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompt_list) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompt_list):
            raise ValueError("one SamplingParams, or one per prompt")
        prios = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(prios) != len(prompt_list):
            raise ValueError("one priority per prompt")
        # validate everything before starting anything, so a bad prompt fails the call cleanly
        ids = []
        for prompt, p in zip(prompt_list, params):
            tokens = self.engine.encode(prompt)
            self.engine.check(tokens, p)
            ids.append(tokens)
        requests = []
        for prompt, tokens, p, prio in zip(prompt_list, ids, params, prios):
            req = self.engine.add_request(f"offline-{next(self._ids)}", tokens, p, prio)
            req.prompt = prompt if isinstance(prompt, str) else None
            requests.append(req)
        while self.engine.has_unfinished():
            self.engine.step()
        return [final_output(r) for r in requests]

    def stats(self) -> dict:
        return self.engine.stats()
