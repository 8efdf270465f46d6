"""Fixtures for the decoder Triton-side tests: tiny tokenizers, an engine test double, emit helpers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny_tokenizers  # noqa: E402


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    return tmp_path / "cache"


@pytest.fixture(scope="session")
def tokenizer_dirs(tmp_path_factory) -> dict[str, Path]:
    """Hugging Face directories holding a tiny byte-level (GPT-2 style) and SentencePiece-style tokenizer."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {kind: tiny_tokenizers.make(root / kind, kind, extra_eos=5 if kind == "sentencepiece" else None)
            for kind in ("byte_level", "sentencepiece")}


@pytest.fixture
def hf_dir(tokenizer_dirs) -> Path:
    return tokenizer_dirs["byte_level"]
