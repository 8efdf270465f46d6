"""Tiny randomized Llama/Mistral checkpoints and transformers logits for the llama tests."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np


def randomize(model, seed: int = 0, std: float = 0.15) -> None:
    """Weights large enough that a wrong split, head order or RoPE moves the logits visibly."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else std * noise)


def save_tokenizer(path: Path) -> None:
    """A character-level tokenizer (what calibration needs; no hub download)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set(string.whitespace) | {" ", "\n"})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)


def make_llama(path: Path, *, arch: str = "llama", hidden=64, layers=3, heads=8, kv_heads=2, inter=96,
               vocab=101, tokenizer=False, seed=0, **extra) -> Path:
    """A Llama (or Mistral) checkpoint; defaults give GQA with fewer KV heads than tp 4."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    mistral = arch == "mistral"
    config_cls, model_cls = (MistralConfig, MistralForCausalLM) if mistral else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(seed)
    model = model_cls(config_cls(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                 num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                                 max_position_embeddings=64, bos_token_id=1, eos_token_id=2, **extra))
    randomize(model, seed)
    model.save_pretrained(path)
    if tokenizer:
        save_tokenizer(path)
    return path


def hf_logits(model_dir: Path, ids) -> np.ndarray:
    """transformers' float32 logits for one sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].numpy()
