"""Fixtures for the gpt family: an isolated cache, the decoder plugins, tiny randomized GPT-2 checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

import forge_gpt
import forge_llama
from forge.testing import use_plugins
from gpt_models import make_gpt2


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
def tiny_gpt2(tmp_path_factory) -> Path:
    return make_gpt2(tmp_path_factory.mktemp("models") / "gpt2-tiny")


@pytest.fixture(scope="session")
def quant_gpt2(tmp_path_factory) -> Path:
    """Widths TensorRT-LLM's weight-only layers take unpadded up to tp 2 (multiples of 64·2), odd vocab, a tokenizer."""
    return make_gpt2(tmp_path_factory.mktemp("models") / "gpt2-quant", n_embd=128, n_layer=2, n_head=4,
                     vocab_size=101, n_positions=64, tokenizer=True)
