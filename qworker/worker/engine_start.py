"""Load the worker's engine from its settings; any failure is one line naming the settings.

A misconfigured pod must say what to change in one line (and exit 2), not print the engine's
traceback: a device this machine lacks, a KV budget too small for two blocks, a model folder
whose files do not load. The engine knows its own parameters but not the ``QWORKER_*`` names
an operator sets, so the translation happens here, where both are known.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from qworker.config import ENV_PREFIX, WorkerSettings

# settings that shape the engine, as engine_config() passes them on
ENGINE_SETTINGS = ("model", "device", "dtype", "kv_cache_memory", "kv_cache_dtype", "block_size", "max_num_seqs", "max_num_batched_tokens",
                   "swap_space", "enable_prefix_caching", "grammar_cache_size", "grammar_cache_bytes", "grammar_compile_timeout", "speculative_config",
                   "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "tensor_parallel_size")


class EngineStartError(Exception):
    """The engine could not be built or started from the settings; the message is one line."""


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:1000]


def given(settings: WorkerSettings) -> str:
    """The engine settings that were set, as ``QWORKER_X='value'`` pairs."""
    return ", ".join(f"{ENV_PREFIX}{k.upper()}={getattr(settings, k)!r}" for k in ENGINE_SETTINGS
                     if k in type(settings).model_fields and getattr(settings, k) is not None)


def check_device(settings: WorkerSettings) -> None:
    """A CUDA device on a machine without one fails here, by name (the engine's own error,
    about pinned memory, does not say that the device is missing)."""
    device = settings.device or ""
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        have = f"{count} CUDA device(s)" if count else "no CUDA device"
        raise EngineStartError(f"{ENV_PREFIX}DEVICE={device!r}: this machine has {have}; use cpu, or run where the device exists")


async def load_engine(settings: WorkerSettings) -> Any:
    """A started ``AsyncEngine`` for ``settings`` (built in a thread, so probes keep answering
    while the weights load); raises ``EngineStartError`` with one line on any failure."""
    from qworker.engine import AsyncEngine

    check_device(settings)
    try:
        engine = await asyncio.to_thread(lambda: AsyncEngine.from_model(settings.model, **settings.engine_config()))
    except Exception as e:  # noqa: BLE001 - any failure to build it is the settings' (or the files') fault
        raise EngineStartError(f"the engine did not load ({given(settings)}): {type(e).__name__}: {_one_line(e)}") from e
    try:
        await engine.start()
    except Exception as e:  # noqa: BLE001
        with contextlib.suppress(Exception):  # the start's error is the one to report
            await engine.shutdown()
        raise EngineStartError(f"the engine did not start ({given(settings)}): {type(e).__name__}: {_one_line(e)}") from e
    return engine
