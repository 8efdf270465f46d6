"""CLIP's byte-level BPE tokenizer in Hugging Face form, built from open_clip's own vocabulary file."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

from forge.errors import UsageError

VOCAB_FILE = "bpe_simple_vocab_16e6.txt.gz"
BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def open_clip_dir() -> Path:
    """The installed open_clip package directory (found without importing torch)."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("open_clip models need the open_clip_torch package", hint="pip install open_clip_torch")
    return Path(list(spec.submodule_search_locations)[0])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte → printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def vocab_and_merges(bpe_file: Path | None = None) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary (49408 entries; ids as open_clip assigns them) and its BPE merges."""
    path = bpe_file or open_clip_dir() / VOCAB_FILE
    lines = gzip.open(path).read().decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1:49152 - 256 - 2 + 1]]
    base = list(_bytes_to_unicode().values())
    tokens = base + [t + "</w>" for t in base] + ["".join(m) for m in merges] + [BOS, EOS]
    return {token: index for index, token in enumerate(tokens)}, merges


def clip_tokenizer(context_length: int = 77, bpe_file: Path | None = None):
    """A ``transformers`` CLIPTokenizer equal to open_clip's SimpleTokenizer on ordinary text."""
    from transformers import CLIPTokenizer

    vocab, merges = vocab_and_merges(bpe_file)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=context_length)
