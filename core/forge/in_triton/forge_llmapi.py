"""The request and response tensors of TensorRT-LLM's LLM-API ``tensorrt_llm`` model, checked and mapped.

Shipped as ``1/forge_llmapi.py`` beside the ``model.py`` of both targets of an LLM-API repository: the
``tensorrtllm`` target's model hands :attr:`LLMRequest.sampling` to ``tensorrt_llm.SamplingParams`` and
:attr:`LLMRequest.lora` to ``tensorrt_llm.executor.LoRARequest`` and reads the LLM API's ``RequestOutput``
back with :class:`LLMAnswer`; forge's python target reads the same request into its own engine. One parser
means both answer the same request alike, errors included.

The interface (``all_models/llmapi/tensorrt_llm/config.pbtxt``): ``text_input`` (one prompt, element 0),
``sampling_param_*`` scalars named after ``SamplingParams``' keywords (``sampling_param_stop`` a list of
strings), ``return_finish_reason`` / ``return_stop_reason`` / ``return_cumulative_logprob`` asking for those
outputs, ``streaming`` (decoupled models only), ``stop`` (cancel the request with the same id), the LoRA
triple ``lora_id`` / ``lora_name`` / ``lora_path`` (+ ``lora_ckpt_source``) and ``image_url``. An absent
``sampling_param_exclude_input_from_output`` means False there (the prompt is echoed in ``text_output``),
unlike SamplingParams' own default; an absent ``sampling_param_max_tokens`` takes SamplingParams' default.
forge adds optional inputs and outputs to it (:data:`EXTENSION_INPUTS`, :data:`EXTENSION_OUTPUTS`), which both
targets declare and serve: token-id prompts, log-probs, token counts, ``ignore_eos`` / ``min_tokens`` /
``repetition_penalty``.

It imports numpy only (never forge, never tensorrt_llm), so the build and the tests import it too.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np

#: request input → SamplingParams keyword, with the Python type it takes
SAMPLING = {
    "sampling_param_best_of": ("best_of", int),
    "sampling_param_temperature": ("temperature", float),
    "sampling_param_top_k": ("top_k", int),
    "sampling_param_top_p": ("top_p", float),
    "sampling_param_frequency_penalty": ("frequency_penalty", float),
    "sampling_param_presence_penalty": ("presence_penalty", float),
    "sampling_param_max_tokens": ("max_tokens", int),
    "sampling_param_seed": ("seed", int),
    "sampling_param_exclude_input_from_output": ("exclude_input_from_output", bool),
    "sampling_param_return_perf_metrics": ("return_perf_metrics", bool),
    # forge's additions (EXTENSION_INPUTS): log-probs of each generated / prompt token and this many
    # alternatives, as SamplingParams' logprobs / prompt_logprobs
    "sampling_param_logprobs": ("logprobs", int),
    "sampling_param_prompt_logprobs": ("prompt_logprobs", int),
    # forge's additions, as SamplingParams' keywords of the same names
    "sampling_param_ignore_eos": ("ignore_eos", bool),
    "sampling_param_min_tokens": ("min_tokens", int),
    "sampling_param_repetition_penalty": ("repetition_penalty", float),
}
PROMPT_IDS = "prompt_token_ids"  # the prompt as token ids instead of text_input (forge's addition)
MAX_LOGPROBS = 20  # alternatives per token at most (vLLM's default max_logprobs, OpenAI's top_logprobs limit)
#: what forge adds to the interface, optional, declared by both targets: (name, Triton data type, dims)
EXTENSION_INPUTS = ((PROMPT_IDS, "INT32", -1), ("sampling_param_logprobs", "INT32", 1),
                    ("sampling_param_prompt_logprobs", "INT32", 1), ("sampling_param_ignore_eos", "BOOL", 1),
                    ("sampling_param_min_tokens", "INT32", 1), ("sampling_param_repetition_penalty", "FP32", 1),
                    ("return_num_input_tokens", "BOOL", 1), ("return_num_output_tokens", "BOOL", 1))
#: JSON per response, as Triton's vLLM backend writes ``logprobs``: a list with one object per token, token id →
#: {"logprob", "rank", "decoded_token"}, the generated (or prompt) token first; ``prompt_logprobs`` leads with
#: null (nothing predicts the first prompt token) and comes in the first response only
EXTENSION_OUTPUTS = (("logprobs", "STRING", -1), ("prompt_logprobs", "STRING", -1),
                     ("num_input_tokens", "INT32", 1), ("num_output_tokens", "INT32", 1))
STOP_STRINGS = "sampling_param_stop"  # → SamplingParams(stop=[...])
#: the outputs a request asks for with a flag; ``text_output`` is in every response
RETURNS = {"return_finish_reason": "finish_reason", "return_stop_reason": "stop_reason",
           "return_cumulative_logprob": "cumulative_logprob",
           # forge's additions (EXTENSION_INPUTS): the prompt's tokens, the tokens generated so far
           "return_num_input_tokens": "num_input_tokens", "return_num_output_tokens": "num_output_tokens"}
#: what ``sampling_param_return_perf_metrics`` adds to the response
PERF_OUTPUTS = ("kv_cache_reused_block", "kv_cache_missed_block", "kv_cache_alloc_new_blocks",
                "kv_cache_alloc_total_blocks", "kv_cache_hit_rate", "arrival_time_ns", "first_scheduled_time_ns",
                "first_token_time_ns", "last_token_time_ns", "acceptance_rate", "total_accepted_draft_tokens",
                "total_draft_tokens")
LORA_INPUTS = ("lora_id", "lora_name", "lora_path")
LORA_SOURCES = ("hf", "nemo")
DEFAULT_MAX_TOKENS = 32  # SamplingParams.max_tokens' default
# image_url: only what the client can name without reaching the server's files (http(s) URLs, inline data)
IMAGE_SCHEMES = ("http://", "https://", "data:")


class RequestError(ValueError):
    """A request the model refuses; the message goes back to the client, the model keeps serving."""


@dataclass
class LLMRequest:
    """One request of the LLM-API interface, checked."""

    prompt: str
    prompt_ids: list[int] | None = None  # ``prompt_token_ids``: the prompt as token ids (``prompt`` is then empty)
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keywords the request set
    streaming: bool = False
    returns: frozenset[str] = frozenset()  # outputs asked for besides text_output
    lora: dict[str, Any] | None = None  # LoRARequest keywords
    images: list[str] = field(default_factory=list)

    @property
    def max_tokens(self) -> int:
        return int(self.sampling.get("max_tokens", DEFAULT_MAX_TOKENS))

    @property
    def echo(self) -> bool:
        """Whether ``text_output`` starts with the prompt (the interface's default)."""
        return not self.sampling.get("exclude_input_from_output", False)


def _scalar(name: str, value: np.ndarray) -> Any:
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise RequestError(f"{name} takes one value, got {flat.size}")
    item = flat[0]
    return item.decode("utf-8", "replace") if isinstance(item, bytes) else item.item() if hasattr(item, "item") \
        else item


def _strings(name: str, value: np.ndarray) -> list[str]:
    out = []
    for item in np.asarray(value).reshape(-1):
        if isinstance(item, bytes):
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError(f"{name} is not valid UTF-8") from None
        out.append(str(item))
    return out


def is_stop(tensors: Mapping[str, np.ndarray]) -> bool:
    """A ``stop`` request: cancel the running request with the same id."""
    value = tensors.get("stop")
    return value is not None and bool(np.asarray(value).reshape(-1)[:1].any())


def _check_sampling(sampling: dict[str, Any], max_tokens_limit: int | None) -> None:
    checks = (("max_tokens", lambda v: v >= 1, "at least 1"), ("best_of", lambda v: v >= 1, "at least 1"),
              ("top_k", lambda v: v >= 0, "0 or more"), ("top_p", lambda v: 0.0 <= v <= 1.0, "in [0, 1]"),
              ("temperature", lambda v: v >= 0.0, "0 or more"),
              ("frequency_penalty", lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
              ("presence_penalty", lambda v: -2.0 <= v <= 2.0, "in [-2, 2]"),
              ("seed", lambda v: 0 <= v < 2 ** 64, "in [0, 2^64)"),
              ("logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
              ("prompt_logprobs", lambda v: 0 <= v <= MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]"),
              ("min_tokens", lambda v: v >= 0, "0 or more"), ("repetition_penalty", lambda v: v > 0.0, "above 0"))
    for name, ok, wanted in checks:
        if name in sampling and not ok(sampling[name]):
            raise RequestError(f"sampling_param_{name} must be {wanted}, got {sampling[name]}")
    if max_tokens_limit is not None and sampling.get("max_tokens", 0) > max_tokens_limit:
        raise RequestError(f"sampling_param_max_tokens {sampling['max_tokens']} exceeds what this model can generate "
                           f"({max_tokens_limit})")


def check_image_url(url: str) -> str:
    """An ``image_url`` value the server may fetch: http(s) or inline ``data:``; never a file it can open."""
    text = url.strip()
    if not text.lower().startswith(IMAGE_SCHEMES):
        raise RequestError(f"image_url {text[:60]!r} is refused: only http(s) URLs and data: URIs are accepted "
                           "(file:// and local paths would let a client read the server's files)")
    return text


def parse(tensors: Mapping[str, np.ndarray], *, decoupled: bool, multimodal: bool = False,
          max_tokens_limit: int | None = None) -> LLMRequest:
    """The request in ``tensors`` (name → numpy array), checked; :class:`RequestError` for a bad one."""
    if "text_input" not in tensors:
        raise RequestError("text_input is required")
    prompts = _strings("text_input", tensors["text_input"])
    if not prompts:
        raise RequestError("text_input is empty")
    sampling: dict[str, Any] = {}
    for name, (keyword, kind) in SAMPLING.items():
        if name not in tensors:
            continue
        value = _scalar(name, tensors[name])
        try:
            sampling[keyword] = bool(value) if kind is bool else kind(value)
        except (TypeError, ValueError, OverflowError):
            raise RequestError(f"{name} must be {kind.__name__}, got {value!r}") from None
        if kind is float and not np.isfinite(sampling[keyword]):
            raise RequestError(f"{name} must be a finite number, got {value!r}")
    if STOP_STRINGS in tensors:
        stops = [s for s in _strings(STOP_STRINGS, tensors[STOP_STRINGS]) if s]
        if stops:
            sampling["stop"] = stops
    _check_sampling(sampling, max_tokens_limit)
    streaming = "streaming" in tensors and bool(_scalar("streaming", tensors["streaming"]))
    if streaming and not decoupled:
        raise RequestError("Streaming is only supported in decoupled mode.")
    returns = {output for flag, output in RETURNS.items() if flag in tensors and bool(_scalar(flag, tensors[flag]))}
    if sampling.get("return_perf_metrics"):
        returns.update(PERF_OUTPUTS)
    images = []
    if "image_url" in tensors:
        urls = [u for u in _strings("image_url", tensors["image_url"]) if u.strip()]
        if urls and not multimodal:
            raise RequestError("image_url is not accepted: this model is not multimodal (triton_config.multimodal)")
        images = [check_image_url(u) for u in urls]
    prompt_ids = _prompt_ids(tensors, prompts[0])
    return LLMRequest(prompts[0], prompt_ids, sampling, streaming, frozenset(returns), _lora(tensors), images)


def _prompt_ids(tensors: Mapping[str, np.ndarray], prompt: str) -> list[int] | None:
    if PROMPT_IDS not in tensors:
        return None
    ids = np.asarray(tensors[PROMPT_IDS]).reshape(-1)
    if ids.size == 0:
        raise RequestError(f"{PROMPT_IDS} is empty")
    if prompt:
        raise RequestError(f"send the prompt as text_input or as {PROMPT_IDS}, not both (text_input must be empty)")
    if not np.issubdtype(ids.dtype, np.integer):
        raise RequestError(f"{PROMPT_IDS} must be integers")
    return [int(t) for t in ids]


def _lora(tensors: Mapping[str, np.ndarray]) -> dict[str, Any] | None:
    """``lora_id`` / ``lora_name`` / ``lora_path`` (all three, or none) as LoRARequest keywords."""
    given = [name for name in LORA_INPUTS if name in tensors]
    if not given and "lora_ckpt_source" not in tensors:
        return None
    missing = [name for name in LORA_INPUTS if name not in tensors]
    if missing:
        raise RequestError(f"a LoRA request needs lora_id, lora_name and lora_path together; missing "
                           f"{', '.join(missing)}")
    try:
        lora_id = int(_scalar("lora_id", tensors["lora_id"]))
    except (TypeError, ValueError):
        raise RequestError("lora_id must be an integer") from None
    name = str(_scalar("lora_name", tensors["lora_name"])).strip()
    path = str(_scalar("lora_path", tensors["lora_path"])).strip()
    source = str(_scalar("lora_ckpt_source", tensors["lora_ckpt_source"])).strip() \
        if "lora_ckpt_source" in tensors else "hf"
    if not name or not path:
        raise RequestError("lora_name and lora_path must not be empty")
    if source not in LORA_SOURCES:
        raise RequestError(f"lora_ckpt_source must be one of {', '.join(LORA_SOURCES)}, got {source!r}")
    return {"lora_name": name, "lora_int_id": lora_id, "lora_path": path, "lora_ckpt_source": source}


def resolve_lora_path(lora: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """``lora_path`` as the server sees it: relative paths under the model directory's ``lora/``, which must
    exist (an adapter the build shipped); absolute paths must exist on the server."""
    path = lora["lora_path"]
    if not os.path.isabs(path):
        base = os.path.realpath(os.path.join(model_dir, "lora"))
        resolved = os.path.realpath(os.path.join(base, path))
        if not resolved.startswith(base + os.sep):
            raise RequestError(f"lora_path {path!r} leaves the model's lora/ directory")
        path = resolved
    if not os.path.isdir(path):
        raise RequestError(f"lora_path {lora['lora_path']!r} is not an adapter directory on the server")
    return {**lora, "lora_path": path}


@dataclass
class Completion:
    """What one response reports, whichever engine produced it."""

    text: str
    finish_reason: str | None = None  # "stop", "length", "cancelled"; None while streaming
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    cumulative_logprob: float | None = None
    perf: Mapping[str, float] = field(default_factory=dict)  # PERF_OUTPUTS the engine measured
    tokens: tuple[int, int] | None = None  # (prompt, generated so far), where the engine counts them
    logprobs: list | None = None  # EXTENSION_OUTPUTS' objects of this response's tokens
    prompt_logprobs: list | None = None  # and of the prompt's (the first response)


def outputs(completion: Completion, request: LLMRequest, configured: Mapping[str, np.dtype],
            wanted: set[str] | None = None) -> dict[str, np.ndarray]:
    """The response tensors for ``completion``: ``text_output`` always, the asked-for outputs, each typed as
    ``configured`` (output name → numpy dtype) declares and shaped ``[1]``."""
    values: dict[str, Any] = {"text_output": completion.text}
    if "finish_reason" in request.returns:
        values["finish_reason"] = completion.finish_reason or ""
    if "stop_reason" in request.returns:
        values["stop_reason"] = "" if completion.stop_reason is None else str(completion.stop_reason)
    if "cumulative_logprob" in request.returns:
        values["cumulative_logprob"] = completion.cumulative_logprob if completion.cumulative_logprob is not None \
            else 0.0
    for name in PERF_OUTPUTS:
        if name in request.returns and name in completion.perf:
            values[name] = completion.perf[name]
    if completion.tokens is not None:
        for name, count in zip(("num_input_tokens", "num_output_tokens"), completion.tokens):
            if name in request.returns:
                values[name] = count
    if "logprobs" in request.sampling:
        values["logprobs"] = json.dumps(completion.logprobs or [])
    if "prompt_logprobs" in request.sampling and completion.prompt_logprobs is not None:
        values["prompt_logprobs"] = json.dumps(completion.prompt_logprobs)
    out = {}
    for name, value in values.items():
        dtype = configured.get(name)
        if dtype is None or (wanted is not None and name not in wanted):
            continue
        if dtype == np.object_:
            out[name] = np.array([str(value).encode("utf-8")], dtype=np.object_)
        else:
            out[name] = np.array([value], dtype=dtype)
    return out


def engine_arguments(path: str, model_dir: str) -> tuple[dict, dict]:
    """(LLM keywords, triton_config) of ``model.yaml``: relative ``model`` / ``lora_config.lora_dir`` paths are
    the repository's own and resolve against the model's version directory."""
    import yaml  # PyYAML: the LLM API reads model.yaml with it too

    with open(path if os.path.isabs(path) else os.path.join(model_dir, path)) as handle:
        args = yaml.safe_load(handle) or {}
    triton = args.pop("triton_config", None) or {}
    for key in ("max_batch_size", "decoupled"):
        if key not in triton:
            raise ValueError(f"model.yaml: triton_config.{key} is required")
    model = str(args.get("model", ""))
    if model and not os.path.isabs(model) and os.path.exists(os.path.join(model_dir, model)):
        args["model"] = os.path.join(model_dir, model)
    lora = args.get("lora_config") or {}
    if lora.get("lora_dir"):
        lora["lora_dir"] = [d if os.path.isabs(d) else os.path.join(model_dir, d) for d in lora["lora_dir"]]
    return args, triton


def request_arguments(request: LLMRequest, model_dir: str) -> dict:
    """The arguments of ``generate_async`` for ``request`` (before the LLM API's classes wrap them): ``inputs``,
    ``sampling`` (SamplingParams keywords), ``lora`` (LoRARequest keywords), ``streaming`` and ``options`` (its
    other keywords)."""
    inputs: Any
    if request.prompt_ids is not None:  # the LLM API's TokensPrompt: {"prompt_token_ids": [...]}
        inputs = {"prompt_token_ids": list(request.prompt_ids)}
    else:
        inputs = request.prompt if not request.images else {"prompt": request.prompt}
    if request.images:
        inputs["multi_modal_data"] = {"image": list(request.images)}
    lora = None if request.lora is None else resolve_lora_path(request.lora, model_dir)
    # model.py puts the prompt before the answer itself (LLMRequest.echo): the LLM's outputs stay the generated
    # tokens, which the log-probs and token counts are read beside
    sampling = {**request.sampling, "exclude_input_from_output": True}
    options: dict[str, Any] = {}
    if "prompt_logprobs" in sampling:
        # the PyTorch backend computes prompt log-probs from the prefill's context logits, which a prompt prefix
        # found in the KV cache skips (TensorRT-LLM's own tests turn block reuse off for them, nvbug 5577178):
        # a salt of its own keeps this request from reusing any cached block
        options["cache_salt"] = secrets.token_hex(16)
    return {"inputs": inputs, "sampling": sampling, "lora": lora, "streaming": request.streaming,
            "options": options}


def check_token_ids(ids: Sequence[int], vocab_size: int | None) -> None:
    """:class:`RequestError` for a ``prompt_token_ids`` id the model has no embedding for (a GPU would fault on it)."""
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is not None:
        where = f"[0, {vocab_size})" if vocab_size is not None else "(token ids are not negative)"
        raise RequestError(f"{PROMPT_IDS}: token id {bad} is outside the vocabulary {where}")


def checkpoint_vocab_size(checkpoint: str) -> int | None:
    """The embedding rows of the Hugging Face checkpoint in ``checkpoint`` (``config.json``'s ``vocab_size``, or its
    ``text_config``'s for a vision-language model); None where it does not say."""
    try:
        with open(os.path.join(checkpoint, "config.json")) as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        if isinstance(section.get("vocab_size"), int):
            return int(section["vocab_size"])
    return None


# -- the LLM API's answers (the tensorrtllm target) ------------------------------------------------------------
# Read from TensorRT-LLM's source (the newest stored copies of tensorrt_llm/executor/result.py, base_worker.py,
# llmapi/llm.py and tests/unittest/_torch/sampler/test_logits_logprobs.py, the v1.3 line this profile targets):
# ``RequestOutput.prompt_token_ids`` and ``.outputs[0]``, a ``CompletionOutput`` with ``text`` / ``text_diff``,
# ``token_ids`` (the generated tokens so far), ``logprobs`` and ``prompt_logprobs``, each a list with one
# ``dict[token id, Logprob(logprob, rank)]`` per token. ``logprobs`` = k: the top k and the sampled token (k 0:
# the sampled token alone), raw log-softmax of the logits. ``prompt_logprobs`` has one entry per prompt token,
# entry i scoring token i + 1 (the last scores the first generated token), each holding that token.


def _logprob(value: Any, where: str) -> tuple[float, int]:
    rank = getattr(value, "rank", None)
    if rank is None:
        raise RuntimeError(f"TensorRT-LLM's log-probs of {where} carry no rank")
    return float(value.logprob), int(rank)


def position(token: int, entry: Any, token_text: Callable[[int], str], where: str) -> dict[str, dict]:
    """One ``dict[token id, Logprob]`` of TensorRT-LLM as an :data:`EXTENSION_OUTPUTS` object: ``token`` (the
    sampled or prompt token it scores) first, then the alternatives from the most likely down."""
    if not isinstance(entry, Mapping):
        raise RuntimeError(f"TensorRT-LLM answered the log-probs of {where} as {type(entry).__name__}, not as a "
                           "dict of token id → Logprob")
    if token not in entry:
        raise RuntimeError(f"TensorRT-LLM's log-probs of {where} leave out token {token}, the one they score")
    ranked = {int(t): _logprob(value, where) for t, value in entry.items()}
    order = [token] + sorted((t for t in ranked if t != token), key=lambda t: (ranked[t][1], t))
    return {str(t): {"logprob": ranked[t][0], "rank": ranked[t][1], "decoded_token": token_text(t)} for t in order}


def prompt_positions(prompt_ids: Sequence[int], scores: Sequence[Any],
                     token_text: Callable[[int], str]) -> list[dict | None]:
    """TensorRT-LLM's ``prompt_logprobs`` as the ``prompt_logprobs`` output's objects: null for the first prompt
    token (nothing predicts it), then each later prompt token scored by the entry before it."""
    ids = list(prompt_ids)
    if len(scores) < len(ids) - 1:
        raise RuntimeError(f"TensorRT-LLM returned prompt log-probs for {len(scores)} of the prompt's {len(ids)} "
                           "tokens (its context logits skipped a part of the prompt)")
    return [None] + [position(ids[i], scores[i - 1], token_text, f"prompt token {i}") for i in range(1, len(ids))]


def llm_perf(completion: Any) -> dict:
    """The perf outputs the LLM API measured for ``completion`` (what it lacks is left out)."""
    metrics = getattr(completion, "request_perf_metrics", None)
    if metrics is None:
        return {}
    found = {}
    timing = getattr(metrics, "timing_metrics", None)
    for name, attribute in (("arrival_time_ns", "arrival_time"), ("first_scheduled_time_ns", "first_scheduled_time"),
                            ("first_token_time_ns", "first_token_time"), ("last_token_time_ns", "last_token_time")):
        value = getattr(timing, attribute, None)
        if value is not None:
            found[name] = int(value.total_seconds() * 1e9) if hasattr(value, "total_seconds") else int(value)
    kv = getattr(metrics, "kv_cache_metrics", None)
    for name, attribute in (("kv_cache_reused_block", "num_reused_blocks"),
                            ("kv_cache_missed_block", "num_missed_blocks"),
                            ("kv_cache_alloc_new_blocks", "num_new_allocated_blocks"),
                            ("kv_cache_alloc_total_blocks", "num_total_allocated_blocks"),
                            ("kv_cache_hit_rate", "kv_cache_hit_rate")):
        value = getattr(kv, attribute, None)
        if value is not None:
            found[name] = value
    speculative = getattr(metrics, "speculative_decoding", None)
    for name, attribute in (("acceptance_rate", "acceptance_rate"),
                            ("total_accepted_draft_tokens", "total_accepted_draft_tokens"),
                            ("total_draft_tokens", "total_draft_tokens")):
        value = getattr(speculative, attribute, None)
        if value is not None:
            found[name] = value
    return found


class LLMAnswer:
    """One request's responses read from the LLM API's ``RequestOutput`` (one per step when streamed, one at the
    end otherwise): the echo once, each generated token's log-probs once, the prompt's in the first response."""

    def __init__(self, request: LLMRequest, token_text: Callable[[int], str]):
        self.request, self.token_text = request, token_text
        self.prefix = request.prompt if request.echo else ""
        self.scored = 0  # generated tokens whose log-probs went out (counted here rather than read from
        # ``logprobs_diff``, so a response that brings no new log-probs repeats none)
        self.prompt_sent = False

    def completion(self, output: Any, final: bool) -> Completion:
        """The :class:`Completion` of ``output`` (the ``RequestOutput`` after one more step, or the last one)."""
        sampling = self.request.sampling
        answer = output.outputs[0]
        text = self.prefix + (answer.text_diff if self.request.streaming else answer.text)
        self.prefix = ""
        token_ids = list(answer.token_ids or [])
        result = Completion(text=text, finish_reason=answer.finish_reason if final else None,
                            stop_reason=answer.stop_reason, cumulative_logprob=answer.cumulative_logprob,
                            perf=llm_perf(answer) if sampling.get("return_perf_metrics") else {},
                            tokens=(len(output.prompt_token_ids or []), len(token_ids)))
        if "logprobs" in sampling:
            result.logprobs = self._generated(token_ids, list(answer.logprobs or []), final)
        if "prompt_logprobs" in sampling and not self.prompt_sent:
            scores = list(answer.prompt_logprobs or [])
            if scores:  # with the first response (the prefill's), kept on the later ones
                result.prompt_logprobs = prompt_positions(output.prompt_token_ids, scores, self.token_text)
                self.prompt_sent = True
            elif final:
                raise RuntimeError("sampling_param_prompt_logprobs was asked, and TensorRT-LLM returned no prompt "
                                   "log-probs")
        return result

    def _generated(self, token_ids: list[int], scores: list, final: bool) -> list[dict]:
        if final and token_ids and not scores:
            raise RuntimeError("sampling_param_logprobs was asked, and TensorRT-LLM returned no log-probs for the "
                               f"{len(token_ids)} generated tokens")
        end = min(len(token_ids), len(scores))  # a stop sequence's tokens leave token_ids, not logprobs
        found = [position(token_ids[i], scores[i], self.token_text, f"generated token {i}")
                 for i in range(self.scored, end)]
        self.scored = max(self.scored, end)
        return found
