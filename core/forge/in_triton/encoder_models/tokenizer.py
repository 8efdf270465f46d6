"""Triton python-backend model: texts → token ids, exactly as the model's own tokenizer does.

Input ``text_input`` (STRING, one text per batch row); outputs ``input_ids`` and, when the encoder
takes it, ``attention_mask`` (INT32). The tokenizer is the Hugging Face ``tokenizer.json`` stored
next to this file; truncation at ``max_length`` keeps the special tokens, as ``transformers`` does.
Padding is to the longest text of the request (``padding=longest``) or to ``max_length``.
"""

from __future__ import annotations

import html
import os

import numpy as np

try:  # the build imports this module as part of forge.in_triton
    from .. import forge_glue
except ImportError:  # inside a repository it sits next to forge_glue.py
    import forge_glue


def _open_clip_cleaner():
    """open_clip's default text cleaning (ftfy, HTML entities, whitespace, lower case)."""
    try:
        import ftfy
    except ImportError:
        raise RuntimeError("this tokenizer cleans text like open_clip and needs the ftfy package "
                           "(pip install ftfy)") from None

    def clean(text: str) -> str:
        text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
        return " ".join(text.split()).lower()

    return clean


#: Text cleaning applied before the tokenizer, as the model's own tokenizer library does it.
CLEANERS = {"none": lambda: None, "open_clip": _open_clip_cleaner}


class TextTokenizer:
    """Tokenize, truncate and pad a batch of texts."""

    def __init__(self, tokenizer_file: str, *, max_length: int, padding: str = "longest", pad_id: int = 0,
                 lowercase: bool = False, clean: str = "none",
                 outputs: tuple[str, ...] = ("input_ids", "attention_mask")):
        from tokenizers import Tokenizer

        if padding not in ("longest", "max_length"):
            raise ValueError(f"padding must be longest or max_length, not {padding!r}")
        if clean not in CLEANERS:
            raise ValueError(f"clean must be one of {', '.join(CLEANERS)}, not {clean!r}")
        self.clean = CLEANERS[clean]()
        self.tokenizer = Tokenizer.from_file(tokenizer_file)
        self.tokenizer.no_padding()  # padding is done below, with the pad id and dtype we need
        self.tokenizer.enable_truncation(max_length)
        self.max_length, self.padding, self.pad_id = max_length, padding, pad_id
        self.lowercase, self.outputs = lowercase, tuple(outputs)

    def __call__(self, texts: list[str]) -> dict[str, np.ndarray]:
        if self.clean is not None:
            texts = [self.clean(t) for t in texts]
        if self.lowercase:
            texts = [t.lower() for t in texts]
        encodings = self.tokenizer.encode_batch(texts)
        width = self.max_length if self.padding == "max_length" else max([len(e.ids) for e in encodings] + [1])
        ids = np.full((len(texts), width), self.pad_id, dtype=np.int32)
        mask = np.zeros((len(texts), width), dtype=np.int32)
        for row, encoding in enumerate(encodings):
            ids[row, :len(encoding.ids)] = encoding.ids
            mask[row, :len(encoding.ids)] = 1
        arrays = {"input_ids": ids, "attention_mask": mask}
        return {name: arrays[name] for name in self.outputs}


def decode_texts(raw: np.ndarray) -> list[str]:
    """A STRING tensor of shape [batch, 1] → one str per row; invalid UTF-8 raises ValueError."""
    if raw.ndim != 2 or raw.shape[1] != 1:
        raise ValueError(f"text_input must have shape [batch, 1], got {list(raw.shape)}")
    if raw.shape[0] == 0:
        raise ValueError("the request holds no texts (empty batch)")
    texts = []
    for row, value in enumerate(raw.reshape(-1)):
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"text {row} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        texts.append(str(value))
    return texts


def from_parameters(params: dict[str, str], directory: str) -> TextTokenizer:
    """Build the tokenizer from the model config's parameters (all strings)."""
    return TextTokenizer(
        os.path.join(directory, params.get("tokenizer_file", "tokenizer.json")),
        max_length=int(params["max_length"]), padding=params.get("padding", "longest"),
        pad_id=int(params.get("pad_id", "0")), lowercase=params.get("lowercase", "false") == "true",
        clean=params.get("clean", "none"),
        outputs=tuple(params.get("outputs", "input_ids,attention_mask").split(",")))




class TritonPythonModel:
    """Triton's entry point."""

    def initialize(self, args):
        config = forge_glue.model_config(args)
        params = forge_glue.parameters(config)
        directory = os.path.join(args["model_repository"], args["model_version"])
        self.tokenizer = from_parameters(params, directory)

    def execute(self, requests):
        return forge_glue.run_each(requests, self._tokenize, "tokenizer")

    def _tokenize(self, request):
        return self.tokenizer(decode_texts(forge_glue.get(request, "text_input")))
