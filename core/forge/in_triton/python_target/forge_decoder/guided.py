"""Guided (constrained) decoding with xgrammar: TensorRT-LLM's ``guided_decoding_guide_type`` / ``_guide``.

A request row may carry a guide: ``json`` (any JSON; the guide text is ignored), ``json_schema`` (a JSON
schema), ``regex``, ``ebnf_grammar`` (xgrammar's EBNF) or ``structural_tag`` (xgrammar's structural tag
JSON; TensorRT-LLM's ``{"structures": [...], "triggers": [...]}`` form too). :class:`Guides` compiles a
guide once for the model's tokenizer (an LRU of compiled grammars by (type, guide)); the engine gives each
guided sequence a :class:`Matcher`, masks the tokens the grammar forbids before choosing one
(:func:`mask`) and feeds the chosen token back (:meth:`Matcher.accept`). When the grammar has ended (its
stop token, the tokenizer's end of sequence or the request's end_id, was chosen) the sequence finishes
as at end_id: the stop token is left out of the output. Rows without a guide are not touched.

xgrammar is imported by this module only (the model imports it at load to log whether guided decoding is
available); without it a guided request gets an error naming the package and every other request is
served as before.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from .request import GUIDE_TYPES, Guide, RequestError

PACKAGE = "xgrammar"
CACHE_SIZE = 64  # compiled grammars kept per model


_import_error = ""


def load_xgrammar():
    """The xgrammar module, or None when it cannot be imported (``_import_error`` says why)."""
    global _import_error
    try:
        import xgrammar
    except Exception as exc:  # noqa: BLE001 - a broken install means the same as a missing one here
        _import_error = f"{type(exc).__name__}: {exc}"
        return None
    return xgrammar


def installed() -> bool:
    """Whether xgrammar is installed, without importing it (a third of a second of every model load)."""
    import importlib.util

    try:
        return importlib.util.find_spec(PACKAGE) is not None
    except (ImportError, ValueError):
        return False


def version() -> str | None:
    """The installed xgrammar's version (None: not installed)."""
    if not installed():
        return None
    try:
        from importlib.metadata import version as dist_version

        return dist_version(PACKAGE)
    except Exception:  # noqa: BLE001
        return "unknown version"


_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


def _one_line(exc: BaseException) -> str:
    """xgrammar's message without its C++ source prefix, on one line."""
    text = str(exc).strip() or type(exc).__name__
    text = _CPP_PREFIX.sub("", text.splitlines()[0] if text else text).strip()
    return text[:300] + ("…" if len(text) > 300 else "")


class Guides:
    """Compiles guides into xgrammar grammars for one model's tokenizer.

    ``tokenizer`` is a directory of Hugging Face tokenizer files (loaded on first use) or a loaded
    tokenizer; ``vocab_size`` is the width of the model's logits (it may exceed the tokenizer's
    vocabulary; ids past it are never allowed).
    """

    def __init__(self, tokenizer: Path | str | Any | None, vocab_size: int, *, cache_size: int = CACHE_SIZE,
                 threads: int = 2):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.threads = max(1, threads)
        self._compiler = None
        self._stop_ids: list[int] = []
        self._cache: OrderedDict[Guide, Any] = OrderedDict()
        self._lock = threading.Lock()

    def unavailable(self, load: bool = True) -> str | None:
        """Why guided requests cannot be served (None: they can, as far as can be told without loading the
        tokenizer); ``load=False`` asks only whether xgrammar is installed (the first guided request imports it)."""
        missing = load_xgrammar() is None if load else not installed()
        if missing:
            return (f"the python package {PACKAGE!r} cannot be imported in the server's environment "
                    f"({_import_error or 'not installed'}; pip install {PACKAGE})")
        if self.tokenizer is None:
            return "no tokenizer was found beside the model"
        return None

    def _compiler_for(self):
        if self._compiler is not None:
            return self._compiler
        reason = self.unavailable()
        if reason is not None:
            raise RequestError(f"guided decoding is not available: {reason}")
        xgr = load_xgrammar()
        tokenizer = self.tokenizer
        if isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(str(tokenizer), trust_remote_code=False)
            except Exception as exc:  # noqa: BLE001
                raise RequestError(f"guided decoding is not available: cannot load the tokenizer in "
                                   f"{self.tokenizer}: {_one_line(exc)}") from None
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
        self._stop_ids = [int(t) for t in info.stop_token_ids]
        self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
        return self._compiler

    def compile(self, guide: Guide):
        """The compiled grammar of ``guide`` (cached); a RequestError with one clear line when it is bad."""
        with self._lock:
            compiled = self._cache.get(guide)
            if compiled is not None:
                self._cache.move_to_end(guide)
                return compiled
            compiler = self._compiler_for()
            try:
                compiled = _compile(compiler, guide)
            except RequestError:
                raise
            except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own types
                raise RequestError(f"guided_decoding_guide is not a valid {guide.kind} guide: {_one_line(exc)}") \
                    from None
            self._cache[guide] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def prepare(self, rows: Sequence[Any]) -> None:
        """Compile the guide of every row that has one into ``row.grammar`` (rows: GenerationRequest)."""
        for row in rows:
            if row.guide is not None:
                row.grammar = Grammar(self.compile(row.guide), self._stop_ids)


def _compile(compiler, guide: Guide):
    if guide.kind == "json":
        return compiler.compile_builtin_json_grammar()
    if guide.kind == "json_schema":
        try:
            schema = json.loads(guide.text)
        except ValueError as exc:
            raise RequestError(f"guided_decoding_guide is not valid JSON, so not a json_schema: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError("guided_decoding_guide is not a JSON schema (a schema is a JSON object)")
        # compact JSON: a model free to add whitespace between tokens can fill max_tokens with it
        return compiler.compile_json_schema(guide.text, any_whitespace=False)
    if guide.kind == "regex":
        return compiler.compile_regex(guide.text)
    if guide.kind == "ebnf_grammar":
        return compiler.compile_grammar(guide.text)
    if guide.kind == "structural_tag":
        return _structural_tag(compiler, guide.text)
    raise RequestError(f"guided_decoding_guide_type {guide.kind!r} is not one of {', '.join(GUIDE_TYPES)}")


def _structural_tag(compiler, text: str):
    """TensorRT-LLM's ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``, else xgrammar's own."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise RequestError(f"guided_decoding_guide is not valid JSON, so not a structural_tag: {exc}") from None
    if isinstance(value, dict) and "structures" in value:
        import xgrammar as xgr

        try:
            tags = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                    for s in value["structures"]]
            triggers = [str(t) for t in value["triggers"]]
        except (KeyError, TypeError) as exc:
            raise RequestError(f"guided_decoding_guide is not a valid structural_tag: each structure needs "
                               f"begin, schema and end, and triggers a list ({type(exc).__name__}: {exc})") from None
        return compiler.compile_structural_tag(tags, triggers)
    return compiler.compile_structural_tag(text)


@dataclass(frozen=True)
class Grammar:
    """A compiled guide and the tokens that end it (the tokenizer's end-of-sequence tokens)."""

    compiled: Any
    stop_ids: Sequence[int]


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, grammar: Grammar, end_id: int | None = None):
        import xgrammar as xgr

        stops = list(grammar.stop_ids)
        if end_id is not None and end_id not in stops:  # the request's end_id ends the grammar as well
            stops.append(int(end_id))
        self.matcher = xgr.GrammarMatcher(grammar.compiled, override_stop_tokens=stops or None)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it."""
        return bool(self.matcher.accept_token(int(token)))

    @property
    def ended(self) -> bool:
        """Whether a stop token ended the grammar."""
        return bool(self.matcher.is_terminated())


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def allowed(matchers: Sequence[Matcher], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(matchers), vocab]`` booleans: the tokens each grammar allows next."""
    words = (vocab + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    for j, matcher in enumerate(matchers):
        matcher.fill(bitmask, j)
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    bits = (bitmask.to(device).unsqueeze(-1) >> shifts) & 1
    return bits.view(len(matchers), words * 32)[:, :vocab].bool()


def mask(logits: torch.Tensor, matchers: Sequence[Matcher | None]) -> torch.Tensor:
    """``logits`` with the tokens each row's grammar forbids at -inf (a copy; rows without one unchanged)."""
    index = [i for i, m in enumerate(matchers) if m is not None]
    if not index:
        return logits
    ok = allowed([matchers[i] for i in index], logits.shape[-1], logits.device)
    out = logits.clone()
    rows = torch.as_tensor(index, device=logits.device)
    out[rows] = out[rows].masked_fill(~ok, float("-inf"))
    return out
