"""Engine-test fixtures: one cached set of tiny random models, one per supported family."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.family_models import build_family_model


class FamilyModels:
    """Builds each family's tiny model on first use, once per test session, in one folder."""

    def __init__(self, root: Path, tokenizer_dir: Path, **overrides):
        self.root = root
        self.tokenizer_dir = tokenizer_dir
        self.overrides = overrides  # config fields every model gets (a smaller vocabulary)
        self._built: dict[str, Path] = {}

    def get(self, model_type: str) -> Path:
        if model_type not in self._built:
            self._built[model_type] = build_family_model(model_type, self.root / model_type, self.tokenizer_dir, **self.overrides)
        return self._built[model_type]


@pytest.fixture(scope="session")
def family_models(tmp_path_factory, model_dir) -> FamilyModels:
    return FamilyModels(tmp_path_factory.mktemp("family-models"), model_dir)
