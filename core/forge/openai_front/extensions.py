"""vLLM's sampling extensions of the OpenAI requests, on the served model: each is carried by an input the served
model takes, done in the front where vLLM does it there (stop strings, ``include_stop_str_in_output``), or refused
with a 400 that names it and says why. None is ignored: a value that asks for nothing (vLLM's default) is
accepted everywhere.

The inputs are TensorRT-LLM's: the engine releases' ensemble names (``top_k``, ``min_tokens``/``min_length``,
``end_id`` …) and the LLM-API model's ``sampling_param_<SamplingParams keyword>``; the first
the served model takes carries the value. TensorRT-LLM's ``end_id`` of -1 ends no sequence, which is how
``ignore_eos`` travels where no ``sampling_param_ignore_eos`` input exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..clients.inference import SAMPLING_INPUTS, first_input
from .catalog import Catalog, TextModel
from .protocol import APIError, _Sampling

STOP_INPUTS = ("stop_words", "sampling_param_stop")  # stop strings, tokenized by the server (see ``translate``)


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Extension:
    """One request field: the values that ask for nothing, and the served inputs that carry any other value
    (the first the served model takes), each with what the value is sent as."""

    field: str
    neutral: tuple[Any, ...]
    carriers: tuple[tuple[str, Callable[[Any], Any]], ...] = ()
    why: str = ""  # said when refused; default: which inputs the served model lacks


def carried(*names: str) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    """Inputs that take the request's value as it is."""
    return tuple((name, _same) for name in names)


EXTENSIONS: tuple[Extension, ...] = (
    Extension("top_k", (None, -1, 0), carried(*SAMPLING_INPUTS["top_k"])),  # -1 and 0: every token (vLLM)
    Extension("min_p", (None, 0.0), carried("min_p", "sampling_param_min_p"),
              why="the served model has no min_p input (TensorRT-LLM's backend samples with top_k / top_p)"),
    Extension("repetition_penalty", (None, 1.0),
              carried(*SAMPLING_INPUTS["repetition_penalty"], "sampling_param_repetition_penalty")),
    Extension("length_penalty", (None, 1.0),
              why="it weighs the beams of a beam search, and this API decodes one beam: it would change nothing"),
    Extension("min_tokens", (0,), carried(*SAMPLING_INPUTS["min_length"], "sampling_param_min_tokens")),
    Extension("ignore_eos", (False,), (("sampling_param_ignore_eos", _same), ("end_id", lambda _: -1))),
    Extension("spaces_between_special_tokens", (True,), carried("sampling_param_spaces_between_special_tokens"),
              why="the served postprocessing decodes with the settings it was built with"),
    Extension("priority", (0,), carried("sampling_param_priority"),
              why="requests are served in arrival order (the served model takes no priority)"),
)


def refuse(field: str, why: str) -> APIError:
    return APIError(400, f"{field} is not supported by this server: {why}", param=field, code="unsupported_parameter")


def served_inputs(model: TextModel, flags: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sampling flags (``translate.sampling``) → the served inputs that carry them; 400 for one it lacks."""
    found = {}
    for flag, value in flags.items():
        candidates = SAMPLING_INPUTS.get(flag, (flag,))
        name = first_input(model.inputs, candidates)
        if name is None:
            raise refuse(flag, f"the served model {model.name!r} has no input for it ({' / '.join(candidates)})")
        found[name] = value
    return found


@dataclass
class Extended:
    """What a request's extensions add to its generation."""

    inputs: dict[str, Any]  # served input → value
    stops: list[str]  # stop strings that stand for stop_token_ids
    include_stop: bool  # stop strings stay in the answer


def extend(catalog: Catalog, model: TextModel, request: _Sampling, max_tokens: int) -> Extended:
    """The served inputs and front-side work of ``request``'s vLLM extensions (400 for one that cannot be
    honoured here)."""
    names = model.inputs.inputs
    inputs: dict[str, Any] = {}
    for extension in EXTENSIONS:
        value = getattr(request, extension.field)
        if value in extension.neutral:
            continue
        carrier = next(((name, send) for name, send in extension.carriers if name in names), None)
        if carrier is None:
            raise refuse(extension.field, extension.why or f"the served model {model.name!r} has no input for it "
                                                           f"({' / '.join(n for n, _ in extension.carriers)})")
        inputs[carrier[0]] = carrier[1](value)
    vocab = model.vocab_size
    if request.top_k is not None and vocab and request.top_k > vocab:
        raise APIError(400, f"top_k {request.top_k} is larger than the vocabulary ({vocab} tokens)", param="top_k")
    if request.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({request.min_tokens}) must not exceed max_tokens ({max_tokens})",
                       param="min_tokens")
    # the repository's own extra end tokens (its preprocessing adds them to every request's stop words)
    ends = (model.parameters.get("stop_token_ids") or "").strip()
    if request.min_tokens and (request.stop or request.stop_token_ids or ends):
        # TensorRT-LLM's min_length holds back the end token only; vLLM's min_tokens holds back stops as well
        which = f"this repository's stop_token_ids {ends}" if ends else "stop or stop_token_ids"
        raise refuse("min_tokens", f"with {which}: the served model's minimum length holds back only its end "
                                   "token, not stop sequences")
    if request.ignore_eos and "end_id" in inputs and ends:
        raise refuse("ignore_eos", f"this repository also ends on the token ids {ends} (its stop_token_ids), "
                                   "which a request cannot turn off")
    if request.skip_special_tokens != catalog.skip_special_tokens:
        if "sampling_param_skip_special_tokens" not in names:
            raise refuse("skip_special_tokens", "the served postprocessing decodes with skip_special_tokens="
                                                f"{str(catalog.skip_special_tokens).lower()}, set when it was built")
        inputs["sampling_param_skip_special_tokens"] = request.skip_special_tokens
    stops = _stop_token_texts(model, request.stop_token_ids or [], inputs)
    include = request.include_stop_str_in_output and bool(request.stop or stops)
    if include and "sampling_param_include_stop_str_in_output" in names:
        inputs["sampling_param_include_stop_str_in_output"] = True
    elif include and first_input(model.inputs, STOP_INPUTS) == "sampling_param_stop":
        raise refuse("include_stop_str_in_output", "the served model cuts stop strings from its answer itself")
    return Extended(inputs, stops, include)


def _stop_token_texts(model: TextModel, ids: list[int], inputs: dict[str, Any]) -> list[str]:
    """stop_token_ids as stop strings: each token's text, which the served preprocessing tokenizes back to
    exactly that token (checked here), so the server stops on the token (where it takes stop words) and the
    front cuts its text."""
    if not ids:
        return []
    if "sampling_param_stop_token_ids" in model.inputs.inputs:
        inputs["sampling_param_stop_token_ids"] = list(ids)
        return []
    if model.tokenizer is None or not hasattr(model.tokenizer, "decode"):
        raise refuse("stop_token_ids", "the served model's tokenizer is unknown to this server")
    from ..in_triton import forge_text

    vocab = len(model.tokenizer)
    texts = []
    for token in ids:
        if token >= vocab:
            raise APIError(400, f"stop_token_ids: {token} is not a token id (the vocabulary has {vocab})",
                           param="stop_token_ids")
        text = model.tokenizer.decode([token], skip_special_tokens=False)
        if not text or forge_text.token_ids(text, model.tokenizer, False) != [token]:
            raise refuse("stop_token_ids", f"token {token} ({text!r}) does not tokenize back to itself, so the "
                                           "served model cannot be asked to stop on it")
        texts.append(text)
    return texts
