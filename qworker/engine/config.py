"""Engine configuration: one dataclass, every field with a default a user can override."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from qworker.engine.spec_decode.config import SpeculativeConfig

MiB = 1 << 20
GiB = 1 << 30


@dataclass(slots=True)
class EngineConfig:
    model: str
    device: str = "auto"  # "cpu", "cuda", "cuda:1", or "auto" (cuda when available)
    dtype: str = "auto"  # "float32", "bfloat16", "float16", or "auto" (fp32 on CPU, bf16 on CUDA)
    # On CPU "bfloat16" runs on qworker's panels GEMM (any CPU the C kernels build for) or oneDNN's
    # bf16 linear (AVX512_BF16/AMX), else a clear error: bf16 weights and GEMMs (fp32 accumulation),
    # fp32 activations between them, a bf16 KV cache unless kv_cache_dtype says.
    # KV cache element type: "auto" (the model's dtype), "float32", "float16" or "bfloat16". A
    # 16-bit cache on an fp32 CPU model holds twice the tokens in the same memory and halves
    # decode attention's memory traffic, at the cost of rounding K/V (greedy outputs can then
    # differ from an fp32 reference where the top two tokens are close). CPU only.
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    # KV pool size: ``kv_cache_memory`` bytes if set, else ``gpu_memory_utilization`` of the
    # device's free memory after loading weights (CUDA), else ``cpu_kv_cache_memory`` (CPU).
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.85
    cpu_kv_cache_memory: int = 512 * MiB
    swap_space: int = 1 * GiB  # bytes of CPU memory for swapped-out KV; 0 disables swapping
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # defaults to the model's context length
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "priority"  # "priority" (lower value first, then FCFS) or "fcfs"
    seed: int = 0
    tokenizer: str | None = None
    # structured output: compiled grammars kept (LRU, keyed by the spec's hash; at most
    # grammar_cache_bytes of them, 256 MiB), seconds a compile may take from its start before its
    # request fails with invalid_structured_output, compile processes
    grammar_cache_size: int = 128
    grammar_cache_bytes: int = 256 * MiB
    grammar_compile_timeout: float = 10.0
    grammar_compile_workers: int = 2
    # speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens":
    # k, "prompt_lookup_max": n_max, "prompt_lookup_min": n_min}, plus our "policy": "always" (as
    # vLLM) or "auto" (only where the measured step cost pays). None: off. Normalised to a
    # SpeculativeConfig.
    speculative_config: Any = None
    # LoRA adapters (vLLM's names): ``enable_lora`` turns them on; at most ``max_loras`` distinct
    # adapters run in one step (device slots), adapters of rank <= ``max_lora_rank``, and
    # ``max_cpu_loras`` adapters kept loaded in CPU memory (LRU; None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # tensor parallelism (vLLM's name): the model sharded over this many ranks (devices); rank 0
    # is this process, ranks 1.. are spawned executors (qworker.model.parallel). 1: off.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        # counts and byte sizes are whole numbers (vLLM's swap_space is GiB as a float: 4.0 here
        # would be 4 bytes, and 1.5 crashed the block allocator)
        for name in ("block_size", "kv_cache_memory", "cpu_kv_cache_memory", "swap_space", "max_num_seqs", "max_num_batched_tokens",
                     "max_model_len", "grammar_cache_size", "grammar_cache_bytes", "grammar_compile_workers", "max_loras",
                     "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be a whole number{' of bytes' if 'memory' in name or name in ('swap_space', 'grammar_cache_bytes') else ''}, "
                                 f"got {value!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.scheduling_policy not in ("priority", "fcfs"):
            raise ValueError(f"scheduling_policy must be 'priority' or 'fcfs', got {self.scheduling_policy!r}")
        if self.kv_cache_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"kv_cache_dtype must be auto, float32, float16 or bfloat16, got {self.kv_cache_dtype!r}")
        if self.swap_space < 0:
            raise ValueError("swap_space must be >= 0")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or unset: the model's context), got {self.max_model_len}")
        if self.grammar_cache_size < 1 or self.grammar_compile_workers < 1 or not self.grammar_compile_timeout > 0 or self.grammar_cache_bytes < 0:
            raise ValueError("grammar_cache_size and grammar_compile_workers must be >= 1, grammar_compile_timeout > 0, grammar_cache_bytes >= 0")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.tensor_parallel_size > 1 and self.enable_lora:
            raise ValueError("enable_lora is not supported with tensor_parallel_size > 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        return cls(model=model, **kwargs)
