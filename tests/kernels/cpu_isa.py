"""The ``isa`` fixture: runs a CPU-kernel test under each vector ISA build (kernels.cpu.ISAS),
skipped with the reason where this CPU lacks the ISA. Import it into a test module."""

from __future__ import annotations

import pytest

from kernels import cpu as kcpu


@pytest.fixture(params=kcpu.ISAS)
def isa(request):
    if request.param not in kcpu.available_isas():
        pytest.skip(f"this CPU lacks {request.param} (available: {', '.join(kcpu.available_isas())})")
    with kcpu.using_isa(request.param):
        assert kcpu.cpu_isa() == request.param and kcpu.cpu_kernels_available()
        yield request.param
