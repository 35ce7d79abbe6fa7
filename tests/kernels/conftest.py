"""Kernel tests: native on CUDA, Triton's interpreter on CPU.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it
is set here, at conftest import, before any kernel module is imported; kernel
modules already imported by other tests (compiled mode) are reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parents[1]
# The repo root first: `kernels` must be the top-level package, whatever the
# pytest invocation (a stale editable install can map it to a namespace).
for p in (str(_HERE), str(_ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for _name in ("kernels.kv_store", "kernels.decode_attention", "kernels.prefill_attention", "kernels.rmsnorm",
                  "kernels.rotary", "kernels.swiglu"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_CUDA else "cpu")


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (``KERNELS_TEST_SEED`` replays one); failures print it."""
    env = os.environ.get("KERNELS_TEST_SEED")
    value = int(env) if env else int.from_bytes(os.urandom(4), "little")
    request.node.kernel_seed = value
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "kernel_seed", None)
    if seed is not None and report.failed:
        report.sections.append(("kernel seed", f"replay with KERNELS_TEST_SEED={seed}"))
