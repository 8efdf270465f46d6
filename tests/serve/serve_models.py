"""A tiny GPT-2 with random weights and a byte-level BPE tokenizer trained offline, as an HF directory."""

from __future__ import annotations

import zlib
from pathlib import Path

CORPUS = [
    "What is machine learning?", "Machine learning is a field of study.", "The capital of France is Paris.",
    "hello world", "Hello world, it's a test.", "streaming text one token at a time",
    "stop words and bad words are lists of words", "a quick brown fox jumps over the lazy dog",
] * 30
EOS = "<|endoftext|>"
MAX_INPUT_LEN, MAX_SEQ_LEN = 64, 128  # the limits the serve tests build with


def make_gpt2(path: Path, *, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_positions: int = 128,
              seed: int = 0) -> Path:
    """Save a random GPT-2 and its tokenizer to ``path``; the vocabulary is the tokenizer's (~330)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=330, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions,
                                       vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos))
    with torch.no_grad():  # larger weights than the default init: less flat, more varied continuations
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
