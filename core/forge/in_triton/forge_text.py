"""Tokenizer helpers shared by forge's preprocessing, postprocessing and BLS models.

Copied next to each python-backend ``model.py`` in a built repository (``1/forge_text.py``, beside
``1/forge_glue.py``), so it imports nothing from forge: only numpy and transformers.

The streaming part solves the classic detokenizer bugs: decoding each streamed token on its own
drops the space that SentencePiece tokenizers encode in the token ("▁Paris" decodes to "Paris"
at the start of a string) and splits multi-byte characters whose bytes arrive in separate tokens.
:class:`TokenBytes` gives the exact bytes a token contributes *in context*, and
:class:`IncrementalDetokenizer` turns a token stream into text pieces whose concatenation equals
the decode of the whole sequence.
"""

from __future__ import annotations

import codecs
import json
import os
import re
from typing import Any, Iterable, Sequence

import numpy as np

try:  # the build and tests import this module as part of forge.in_triton
    from . import forge_glue
except ImportError:  # inside a repository it sits next to forge_glue.py
    import forge_glue

parse_bool, parameters = forge_glue.parse_bool, forge_glue.parameters
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# Text whose tokenization exercises spaces, punctuation, newlines and multi-byte characters;
# TokenBytes checks its own mapping against the tokenizer's decode on it.
_PROBE = "Hello world, it's  a test:\n\tdone. héllo wörld — 日本語 🙂 x"


def resolve_dir(value: str, model_repository: str, model_version: str) -> str:
    """A path parameter: absolute as given, relative to the model's version directory otherwise."""
    if os.path.isabs(value):
        return value
    return os.path.join(model_repository, str(model_version), value)


def load_tokenizer(path: str, trust_remote_code: bool = False, fast: bool = False):
    """The Hugging Face tokenizer stored in ``path`` (no network access); a text model's process does without
    the libraries of vision models (:func:`forge_glue.skip_vision_libraries`). ``fast``: the
    :class:`BackendTokenizer` forge build wrote beside it, where it did and the files are the ones it checked."""
    forge_glue.skip_vision_libraries(path)  # also for transformers imported later (a guided request's grammar)
    found = BackendTokenizer.from_dir(path) if fast and not trust_remote_code else None
    if found is not None:
        return found
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)


#: beside a tokenizer: its ``tokenizers`` backend and what transformers adds to it, checked by forge build
BACKEND_FILE = "forge_tokenizer.json"
#: the files the backend was read from (a changed one makes BACKEND_FILE stale)
_SOURCES = tuple(n for n in forge_glue.TOKENIZER_FILES if not n.startswith(("generation_", "chat_", "config")))
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # transformers' clean_up_tokenization


def _sources_digest(path: str) -> str:
    import hashlib

    digest = hashlib.sha256()
    for name in _SOURCES:
        full = os.path.join(path, name)
        digest.update(name.encode() + (open(full, "rb").read() if os.path.isfile(full) else b"-"))
    return digest.hexdigest()


class BackendTokenizer:
    """What a model process asks of a Hugging Face fast tokenizer (encode, decode, ids to tokens, specials,
    length), from its ``tokenizers`` backend alone.

    transformers' tokenizer classes import its modeling machinery (``torch._dynamo``, ``torch.distributed``):
    about 2 s of every start of a model process on a 2-core CPU. forge build writes :data:`BACKEND_FILE`
    (:func:`describe_backend`) only where this class answers as transformers' tokenizer does on a probe set.
    """

    def __init__(self, doc: dict):
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_str(doc["backend"])
        self.all_special_ids = [int(t) for t in doc["special_ids"]]
        self.clean_up_tokenization_spaces = bool(doc["clean_up"])
        self._len = int(doc["len"])
        self.bos_token_id, self.eos_token_id, self.pad_token_id = (doc["ids"].get(k) for k in ("bos", "eos", "pad"))

    @classmethod
    def from_dir(cls, path: str) -> "BackendTokenizer | None":
        """The tokenizer of :data:`BACKEND_FILE` in ``path`` (None: none there, or written for other files)."""
        try:
            with open(os.path.join(path, BACKEND_FILE)) as handle:
                doc = json.load(handle)
            return cls(doc) if doc.get("sources") == _sources_digest(path) else None
        except Exception:  # noqa: BLE001 - unreadable here (another tokenizers release): transformers' tokenizer
            return None

    def __len__(self) -> int:
        return self._len

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        text = self.backend_tokenizer.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)
        if clean_up_tokenization_spaces is None:
            clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        for before, after in _CLEAN_UP if clean_up_tokenization_spaces else ():
            text = text.replace(before, after)
        return text

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self.backend_tokenizer.id_to_token(int(token_id))


def backend_file(path: str, trust_remote_code: bool = False) -> bytes | None:
    """:data:`BACKEND_FILE`'s bytes for the tokenizer in ``path`` (a Hugging Face directory), or None where a
    :class:`BackendTokenizer` would not answer as transformers' tokenizer does (:func:`describe_backend`) or the
    tokenizer runs code of its own (``trust_remote_code``)."""
    if trust_remote_code:
        return None
    tokenizer = load_tokenizer(path)
    specials = " ".join(str(t) for t in tokenizer.all_special_tokens)
    probes = [f"{specials} Hello, world! It's {specials}here .", "  leading spaces , and 'quotes' n't 's",
              "Line one\nLine two\r\n\ttab 12345 3.14 x=f(y) {\"k\": [1, 2]}", "émoji 🙂 日本語 café — ok"]
    return describe_backend(tokenizer, path, probes)[0]


def describe_backend(tokenizer, path: str, probes: Sequence[str]) -> tuple[bytes | None, str]:
    """(:data:`BACKEND_FILE`'s bytes for the transformers ``tokenizer`` loaded from ``path``, or None; why not).
    Written only where a :class:`BackendTokenizer` of it encodes every probe (with and without special tokens)
    and decodes the ids (skipping special tokens and not, cleaned up by default and not) as ``tokenizer`` does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, f"{type(tokenizer).__name__} has no tokenizers backend"
    spaced = token_ids("a . b ? c ! d , e n't f 's", tokenizer, False)  # whether its decode cleans up spaces
    clean_up = tokenizer.decode(spaced) != tokenizer.decode(spaced, clean_up_tokenization_spaces=False)
    ids = {key: getattr(tokenizer, f"{key}_token_id", None) for key in ("bos", "eos", "pad")}
    doc = {"backend": backend.to_str(), "special_ids": [int(t) for t in tokenizer.all_special_ids],
           "clean_up": clean_up, "len": len(tokenizer), "sources": _sources_digest(path),
           "ids": {key: None if value is None else int(value) for key, value in ids.items()}}
    mine = BackendTokenizer(doc)
    for text in [*probes, _PROBE]:
        for special in (True, False):
            ids = token_ids(text, tokenizer, special)
            if mine.encode(text, special) != ids:
                return None, f"encoding {text[:40]!r} differs from transformers'"
            for skip in (True, False):
                for clean in (None, False):
                    if mine.decode(ids, skip, clean) != tokenizer.decode(ids, skip_special_tokens=skip,
                                                                         clean_up_tokenization_spaces=clean):
                        return None, f"decoding {text[:40]!r} differs from transformers'"
    sample = sorted(set(range(0, len(tokenizer), max(1, len(tokenizer) // 512))) | set(doc["special_ids"]))
    if any(mine.convert_ids_to_tokens(t) != tokenizer.convert_ids_to_tokens(t) for t in sample):
        return None, "its ids map to other tokens than transformers'"
    return json.dumps(doc).encode(), ""


def model_setup(args: dict) -> tuple[dict, dict[str, str], Any]:
    """For a model's ``initialize``: its config (json), its parameters and its tokenizer."""
    config = forge_glue.model_config(args)
    params = parameters(config)
    path = resolve_dir(params.get("tokenizer_dir") or "tokenizer", args["model_repository"], args["model_version"])
    tokenizer = load_tokenizer(path, trust_remote_code=parse_bool(params.get("trust_remote_code"), False), fast=True)
    return config, params, tokenizer


def token_ids(text: str, tokenizer, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def expand_image(ids: list[int], image_token_id: int, placeholder: str, vocab_size: int, rows: int) -> list[int]:
    """Replace the image placeholder token by the prompt table's ids ``vocab_size … vocab_size+rows−1``.

    ``rows`` is the number of visual features of the request's image (0: no image was sent). One image
    per prompt, at the placeholder: a placeholder without an image, or an image without one, is an error.
    """
    where = [i for i, t in enumerate(ids) if t == image_token_id]
    if rows <= 0:
        if where:
            raise ValueError(f"the prompt holds the image placeholder {placeholder} but no image was sent")
        return ids
    if len(where) != 1:
        raise ValueError(f"the prompt must hold the image placeholder {placeholder} exactly once where the image "
                         f"belongs (found {len(where)})")
    at = where[0]
    return ids[:at] + list(range(vocab_size, vocab_size + rows)) + ids[at + 1:]


def word_list(batch: Sequence[Sequence[Any]] | None, batch_size: int, tokenizer,
              extra_ids: Sequence[int] = ()) -> np.ndarray:
    """Stop/bad words in TensorRT-LLM's ``[batch, 2, n]`` layout: flat ids, then end offsets (-1 padded).

    ``batch[i]`` holds the words of request row ``i`` (bytes or str; empty ones are ignored);
    ``extra_ids`` are single-token entries added to every row (e.g. extra end-of-turn ids).
    """
    rows: list[tuple[list[int], list[int]]] = []
    for index in range(batch_size):
        words = list(batch[index]) if batch is not None and index < len(batch) else []
        flat: list[int] = []
        ends: list[int] = []
        for word in words:
            if isinstance(word, bytes):
                word = word.decode("utf-8")
            if not word:
                continue
            ids = token_ids(str(word), tokenizer, add_special_tokens=False)
            if not ids:
                continue
            flat += ids
            ends.append(len(flat))
        for token in extra_ids:
            flat.append(int(token))
            ends.append(len(flat))
        rows.append((flat, ends))
    width = max([1] + [len(flat) for flat, _ in rows])
    out = np.zeros((batch_size, 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for index, (flat, ends) in enumerate(rows):
        out[index, 0, :len(flat)] = flat
        out[index, 1, :len(ends)] = ends
    return out


def embedding_bias(words: Sequence[Sequence[Any]], weights: Sequence[Sequence[float]], vocab_size: int,
                   tokenizer) -> np.ndarray:
    """A ``[batch, vocab_size]`` logit bias: each word's tokens get the word's weight added."""
    bias = np.zeros((len(words), vocab_size), dtype=np.float32)
    for row, (row_words, row_weights) in enumerate(zip(words, weights)):
        if len(row_words) != len(row_weights):
            raise ValueError(f"embedding_bias_words has {len(row_words)} entries but "
                             f"embedding_bias_weights has {len(row_weights)} in row {row}")
        for word, weight in zip(row_words, row_weights):
            if isinstance(word, bytes):
                word = word.decode("utf-8")
            for token in token_ids(str(word), tokenizer, add_special_tokens=False):
                if 0 <= token < vocab_size:
                    bias[row, token] += float(weight)
    return bias


def _byte_level_table() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable character that stands for each byte, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


class TokenBytes:
    """The exact UTF-8 bytes that token ids contribute to decoded text.

    Works from the fast tokenizer's decoder description (byte-level BPE as in GPT-2, or
    SentencePiece-style ``▁`` + byte fallback as in Llama). Any other tokenizer falls back to
    decoding with a context token in front, which is exact for whole characters.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.special = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
        self.vocab_limit = len(tokenizer)
        self._cache: dict[int, bytes] = {}
        self.mode, self.strip_start, self._table, self._fallback = self._describe()
        self._anchor = self._anchor_ids()
        if self.mode != "decode" and not self._self_check():
            self.mode = "decode"

    # -- decoder description ---------------------------------------------------------------
    def _describe(self) -> tuple[str, int, dict[str, int], bool]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return "decode", 0, {}, False
        try:
            decoder = json.loads(backend.to_str()).get("decoder") or {}
        except (ValueError, AttributeError):
            return "decode", 0, {}, False
        parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
        kinds = [p.get("type") for p in parts]
        if kinds == ["ByteLevel"]:
            return "bytelevel", 0, _byte_level_table(), False
        strip = 0
        replace = False
        fallback = False
        for part in parts:
            kind = part.get("type")
            if kind == "Replace" and part.get("pattern", {}).get("String") == "▁" and part.get("content") == " ":
                replace = True
            elif kind == "Metaspace":
                replace = True
                scheme = part.get("prepend_scheme", "always" if part.get("add_prefix_space", True) else "never")
                strip = max(strip, 0 if scheme == "never" else 1)
            elif kind == "ByteFallback":
                fallback = True
            elif kind == "Strip" and part.get("content") == " ":
                strip = max(strip, int(part.get("start", 0)))
            elif kind == "Fuse":
                pass
            else:
                return "decode", 0, {}, False
        if replace:
            return "metaspace", strip, {}, fallback
        return "decode", 0, {}, False

    def _anchor_ids(self) -> list[int]:
        ids = [t for t in token_ids("a", self.tokenizer, add_special_tokens=False) if t not in self.special]
        return ids[-1:] if ids else []

    def _self_check(self) -> bool:
        ids = token_ids(_PROBE, self.tokenizer, add_special_tokens=False)
        expect = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                       clean_up_tokenization_spaces=False)
        return self.bytes_of(ids, at_start=True) == expect.encode("utf-8")

    # -- mapping -------------------------------------------------------------------------------
    def _token(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is not None:
            return cached
        text = self.tokenizer.convert_ids_to_tokens(token_id)
        if text is None:
            raw = b""
        elif self.mode == "bytelevel":
            raw = b"".join(bytes([self._table[c]]) if c in self._table else c.encode("utf-8") for c in text)
        else:
            match = _BYTE_TOKEN.match(text) if self._fallback else None
            raw = bytes([int(match.group(1), 16)]) if match else text.replace("▁", " ").encode("utf-8")
        self._cache[token_id] = raw
        return raw

    def keep(self, ids: Iterable[int]) -> list[int]:
        """``ids`` without out-of-vocabulary ids (prompt-table ids, padding) and skipped specials."""
        kept = []
        for token in ids:
            token = int(token)
            if token < 0 or token >= self.vocab_limit:
                continue
            if self.skip_special_tokens and token in self.special:
                continue
            kept.append(token)
        return kept

    def bytes_of(self, ids: Iterable[int], at_start: bool) -> bytes:
        """The bytes ``ids`` add to the text; ``at_start``: they begin the text (leading-space rules)."""
        raw, _ = self.take(ids, self.strip_start if at_start else 0, at_start)
        return raw

    def take(self, ids: Iterable[int], strip: int, at_start: bool) -> tuple[bytes, int]:
        """Bytes of ``ids`` after removing up to ``strip`` leading spaces; returns what is left to strip."""
        kept = self.keep(ids)
        if not kept:
            return b"", strip
        if self.mode == "decode":
            return self._decoded(kept, at_start), 0
        raw = b"".join(self._token(t) for t in kept)
        while strip and raw:
            if not raw.startswith(b" "):
                return raw, 0
            raw = raw[1:]
            strip -= 1
        return raw, strip

    def _decoded(self, ids: list[int], at_start: bool) -> bytes:
        decode = self.tokenizer.decode
        if at_start or not self._anchor:
            return decode(ids, skip_special_tokens=self.skip_special_tokens,
                          clean_up_tokenization_spaces=False).encode("utf-8")
        whole = decode(self._anchor + ids, skip_special_tokens=self.skip_special_tokens,
                       clean_up_tokenization_spaces=False)
        head = decode(self._anchor, skip_special_tokens=self.skip_special_tokens,
                      clean_up_tokenization_spaces=False)
        return whole[len(head):].encode("utf-8") if whole.startswith(head) else whole.encode("utf-8")


class IncrementalDetokenizer:
    """Turns token ids arriving in pieces into text pieces that never split a character.

    ``"".join(d.push(p) for p in pieces) + d.flush()`` equals the decode of all pieces together.
    """

    def __init__(self, codec: TokenBytes, at_start: bool = True):
        self.codec = codec
        self.at_start = at_start
        self._strip = codec.strip_start if at_start else 0  # leading spaces the decoder drops
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Iterable[int]) -> str:
        ids = list(ids)
        if self.at_start and self.codec.keep(ids):
            raw, self._strip = self.codec.take(ids, self._strip, at_start=True)
            self.at_start = self._strip > 0 and not raw
        else:
            raw, _ = self.codec.take(ids, 0, at_start=False)
        return self._utf8.decode(raw)

    def flush(self) -> str:
        """Whatever is left (an incomplete character at the very end becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def decode(tokenizer, ids: Iterable[int], skip_special_tokens: bool) -> str:
    """The whole-sequence decode postprocessing returns when not streaming."""
    vocab = len(tokenizer)
    kept = [int(t) for t in ids if 0 <= int(t) < vocab]
    return tokenizer.decode(kept, skip_special_tokens=skip_special_tokens)
