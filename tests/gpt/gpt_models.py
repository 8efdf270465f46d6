"""Tiny randomized GPT-2 checkpoints and transformers logits for the gpt tests."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np


def randomize(model, seed: int = 0, std: float = 0.15) -> None:
    """Weights large enough that a wrong split, bias or transpose moves the logits visibly."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "ln" in name or "norm" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * noise)
            else:
                p.copy_(std * noise)


def save_tokenizer(path: Path) -> None:
    """A character-level tokenizer (what calibration needs; no hub download)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set(string.whitespace) | {" ", "\n"})
    vocab = {"<|endoftext|>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                            eos_token="<|endoftext|>").save_pretrained(path)


def make_gpt2(path: Path, *, n_embd=48, n_layer=3, n_head=4, vocab_size=101, n_positions=32, seed=0,
              tokenizer=False) -> Path:
    """A GPT-2 checkpoint with odd vocab (exercises lm_head padding) and tied embeddings."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=n_head, vocab_size=vocab_size,
                                       n_positions=n_positions, bos_token_id=0, eos_token_id=0))
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
