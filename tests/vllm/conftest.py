"""Fixtures for the vllm target: a tiny Llama checkpoint, the vLLM environment (``FORGE_VLLM_PYTHON``), builds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "llama"))
from llama_models import save_tokenizer  # noqa: E402  (the llama tests' character tokenizer)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer Llama with random weights (safetensors) and a character-level tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=101, max_position_embeddings=128,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(path)
    save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def tiny_lora(tiny_llama, tmp_path_factory) -> Path:
    """A PEFT LoRA adapter (rank 4, q/v projections) of ``tiny_llama``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-lora")
    torch.manual_seed(1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The Python of the vLLM environment (``FORGE_VLLM_PYTHON``); the test is skipped without one."""
    python = os.environ.get("FORGE_VLLM_PYTHON")
    if not python or not Path(python).is_file():
        pytest.skip("FORGE_VLLM_PYTHON names no vLLM environment (tox -e vllm makes one)")
    return python


def build(model: Path, out: Path, *extra: str) -> Path:
    """``forge build --family llama --target vllm`` through the real CLI."""
    from forge.cli import main

    assert main(["build", "--family", "llama", "--target", "vllm", "--model", str(model), "--out", str(out),
                 *extra]) == 0
    return out
