"""Fixtures for the deployment checks (helpers live in support.py)."""

from __future__ import annotations

from typing import Any

import pytest

from .support import CHART_DIR, NAMESPACE, RELEASE, Rendered, helm


@pytest.fixture(scope="session")
def chart():
    with helm.Chart.load(str(CHART_DIR)) as loaded:
        yield loaded


@pytest.fixture(scope="session")
def render(chart):
    """render(values) -> Rendered; raises helm_python.HelmError on bad values."""

    def _render(values: dict[str, Any] | None = None, **kw) -> Rendered:
        values = values or {}
        manifests = chart.render(values, name=kw.get("name", RELEASE),
                                 namespace=kw.get("namespace", NAMESPACE), is_install=True)
        return Rendered(manifests, values)

    return _render
