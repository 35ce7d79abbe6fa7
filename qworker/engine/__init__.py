"""The paged, continuous-batching inference engine."""

from qworker.engine.async_engine import AsyncEngine
from qworker.engine.config import EngineConfig
from qworker.engine.llm import LLM
from qworker.engine.llm_engine import Capacity, LLMEngine
from qworker.engine.lora_request import LoRARequest
from qworker.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from qworker.engine.sampling_params import InvalidRequestError, SamplingParams
from qworker.engine.structured import GuidedDecodingParams, StructuredOutputError, StructuredOutputsParams

__all__ = [
    "AsyncEngine",
    "Capacity",
    "CompletionOutput",
    "EngineConfig",
    "GuidedDecodingParams",
    "InvalidRequestError",
    "LLM",
    "LLMEngine",
    "Logprob",
    "LoRARequest",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputError",
    "StructuredOutputsParams",
]
