"""The model shapes the GPU benchmarks build (random weights, seeded; SmolLM2's vocabulary and tokenizer).

Shared by serve_gpu.py (served), engine_gpu.py (the engine alone), serve_tp.py and engine_tp.py.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

SHAPES = {  # Llama shapes; the vocabulary is SmolLM2's so its tokenizer serves both
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3),
    "tinyllama": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8),  # Llama-3-8B's layers (SmolLM2's vocabulary: ~7.2B parameters)
}


SMOLLM2 = dict(vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2,
               max_position_embeddings=8192)


def check_disk(where: Path, needed: int, what: str) -> None:
    """Stop with one line when ``where``'s filesystem has less than ``needed`` bytes (and 10 %) free."""
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    if free < needed * 1.1:
        sys.exit(f"benchmark: {what} needs {needed / 2**30:.1f} GiB and {where} has {free / 2**30:.1f} GiB free")


def free_gpu() -> None:
    """Give back the GPU memory of the engines dropped so far: their reference cycles (an engine and its captured
    graphs) are collected first, then torch's cache is emptied. Call it after ``del engine``."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def make_model(shape: str, tokenizer: Path | None, out: Path, dtype: str = "float16") -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if shape == "gpt2":  # GPT-2 small's shape (124M, its own 50257-token vocabulary): the engine alone only
        if tokenizer is not None:
            sys.exit("benchmark: the gpt2 shape has no tokenizer here; use it with --engine-only")
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config(torch_dtype=dtype)).to(getattr(torch, dtype)).save_pretrained(out)
        return out

    base = json.loads((tokenizer / "config.json").read_text()) if tokenizer else SMOLLM2
    config = LlamaConfig(**{**{k: base[k] for k in ("vocab_size", "rms_norm_eps", "rope_theta", "bos_token_id",
                                                   "eos_token_id", "max_position_embeddings") if k in base},
                            **SHAPES[shape], "tie_word_embeddings": True, "torch_dtype": dtype})
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a 7B model initialises in seconds on a GPU
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    check_disk(out, sum(p.numel() * p.element_size() for p in model.parameters()), f"the {shape} model")
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache() if device == "cuda" else None
    if tokenizer is None:
        return out
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "chat_template.jinja"):
        if (tokenizer / name).is_file():
            shutil.copy2(tokenizer / name, out / name)
    return out
