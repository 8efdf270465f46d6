"""Fixtures for the decoder Triton-side tests: tiny tokenizers, an engine test double, emit helpers."""

from __future__ import annotations

import json
import shutil
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


@pytest.fixture(scope="session")
def tiny_gpt2(tokenizer_dirs, tmp_path_factory) -> Path:
    """A 2-layer GPT-2 with random weights (safetensors) and the byte-level test tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny-gpt2")
    tokenizer = tokenizer_dirs["byte_level"]
    for path in tokenizer.iterdir():
        shutil.copy(path, directory / path.name)
    vocab = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    config = GPT2Config(vocab_size=vocab, n_positions=128, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(directory, safe_serialization=True)
    return directory
