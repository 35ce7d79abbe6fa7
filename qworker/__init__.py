"""qworker: a queue-driven LLM inference worker with a paged, continuous-batching engine."""

from qworker.engine import AsyncEngine, InvalidRequestError, LLM, LoRARequest, RequestOutput, SamplingParams

__all__ = ["AsyncEngine", "InvalidRequestError", "LLM", "LoRARequest", "RequestOutput", "SamplingParams"]
