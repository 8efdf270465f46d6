"""Fixtures for the llama family: an isolated cache, the decoder plugins, tiny randomized Llama/Mistral checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

import forge_gpt
import forge_llama
from forge.testing import use_plugins
from llama_models import make_llama


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def decoder_plugins():
    """The CLI sees exactly the two decoder families, whatever else is installed."""
    with use_plugins(("gpt", forge_gpt.plugin), ("llama", forge_llama.plugin)):
        yield


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_llama(tmp_path_factory.mktemp("models") / "llama-tiny")


@pytest.fixture(scope="session")
def calib_llama(tmp_path_factory) -> Path:
    """Sized for INT4-AWQ at tp 2 (hidden 64 → block 64 divides every per-rank width), with a tokenizer."""
    return make_llama(tmp_path_factory.mktemp("models") / "llama-calib", hidden=64, heads=4, kv_heads=2,
                      inter=128, vocab=128, layers=2, tokenizer=True)


@pytest.fixture(scope="session")
def wide_llama(tmp_path_factory) -> Path:
    """Widths TensorRT-LLM's weight-only layers take unpadded up to tp 2 (multiples of 64·2), with a tokenizer."""
    return make_llama(tmp_path_factory.mktemp("models") / "llama-wide", hidden=128, heads=4, kv_heads=2,
                      inter=256, vocab=101, layers=2, tokenizer=True)
