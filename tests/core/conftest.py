"""Fixtures for core tests: an isolated cache, a toy checkpoint, the toy plugin as the only plugin."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import toyplugin  # noqa: E402

from forge.testing import use_plugins  # noqa: E402


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def toy_model(tmp_path) -> Path:
    model = tmp_path / "toy-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["ToyModel"], "scale": 3.0}))
    return model


@pytest.fixture
def toy():
    """The CLI sees only the toy plugin; ``toy.calls`` records the stages that ran."""
    toyplugin.calls.clear()
    with use_plugins(("toy", toyplugin)):
        yield toyplugin
