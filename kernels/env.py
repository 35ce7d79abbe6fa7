"""The yes/no switches read from the environment (``QWORKER_CPU_*``, ``QWORKER_GC_FREEZE``, ...).

One reading for all of them: unset or empty is the switch's default; 1, true, yes or on is yes;
0, false, no or off is no; anything else is refused naming the variable (a ``false`` read as
"not 0", so "on", silently kept a feature a user meant to turn off). ``qworker run`` checks every
switch of :data:`SWITCHES` before it loads a model (:func:`check_switches`)."""

from __future__ import annotations

import os

# every switch and its default; the modules that read one name it here
SWITCHES: dict[str, bool] = {
    "QWORKER_CPU_KERNELS": True,  # the C kernels (kernels.cpu)
    "QWORKER_CPU_EXTEND": True,  # the C prefill attention (kernels.cpu)
    "QWORKER_CPU_AMX": True,  # bf16 weights in AMX's tile layout (kernels.gemm_cpu)
    "QWORKER_CPU_AMX_EMULATE": False,  # tests: the AMX kernels on software tiles (kernels.cpu)
    "QWORKER_CPU_FUSED_FORWARD": True,  # the layer loop in one C call (qworker.model.decoder)
    "QWORKER_CPU_MOE_KERNEL": True,  # a MoE layer's experts in one C call (qworker.model.moe, kernels.moe_cpu)
    "QWORKER_GC_FREEZE": True,  # the start-up heap out of the cyclic GC (qworker.engine.llm_engine)
    "QWORKER_TP_EXTERNAL_FOLLOWERS": False,  # tensor-parallel ranks started by the deployment
}
_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def switch(name: str) -> bool:
    """The switch ``name`` (one of :data:`SWITCHES`) as the environment sets it, else its default."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return SWITCHES[name]
    if raw in _YES:
        return True
    if raw in _NO:
        return False
    raise ValueError(f"{name} must be 1/true/yes/on or 0/false/no/off, got {os.environ[name]!r}")


def check_switches() -> None:
    """Raises ValueError naming the first switch set to something other than yes or no."""
    for name in SWITCHES:
        switch(name)
