"""Tiny Hugging Face tokenizers trained offline, in the two styles decoders use.

``byte_level`` is GPT-2 style byte-level BPE; ``sentencepiece`` is Llama style (``▁`` for spaces,
byte fallback for characters outside the vocabulary, one leading space stripped on decode).
Both are saved as Hugging Face directories (tokenizer.json, tokenizer_config.json, config.json,
generation_config.json) so they load with ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "hello world", "Hello world, it's a test.", "The capital of France is Paris.",
    "What is machine learning?", "stop words and bad words are lists of words",
    "héllo wörld", "naïve café", "streaming text one token at a time",
] * 40


def _train(kind: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        # A small alphabet sends rare characters (é, 日, 🙂) through the <0xNN> byte tokens.
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                      limit_alphabet=40)
    tok.train_from_iterator(CORPUS, trainer)
    if kind != "byte_level":
        from tokenizers import processors

        data = json.loads(tok.to_str())
        vocab = data["model"]["vocab"]
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
        tok = Tokenizer.from_str(json.dumps(data))

        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", bos)])
    return tok


def make(directory: Path, kind: str = "byte_level", *, extra_eos: int | None = None) -> Path:
    """Write a tiny tokenizer of ``kind`` ("byte_level" or "sentencepiece") into ``directory``."""
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    tok = _train(kind)
    if kind == "byte_level":
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                       eos_token="<|endoftext|>", unk_token="<|endoftext|>")
        arch, model_type = "GPT2LMHeadModel", "gpt2"
    else:
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                       unk_token="<unk>")
        arch, model_type = "LlamaForCausalLM", "llama"
    fast.save_pretrained(directory)
    eos = fast.eos_token_id
    (directory / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": model_type, "vocab_size": len(fast),
        "bos_token_id": fast.bos_token_id, "eos_token_id": eos}))
    generation = {"bos_token_id": fast.bos_token_id,
                  "eos_token_id": [eos, extra_eos] if extra_eos is not None else eos}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory
