"""Turn the tensors of one TensorRT-LLM-style request into checked generation requests.

The tensor names and meanings are those of the ``tensorrt_llm`` model of tensorrtllm_backend
(``input_ids``, ``request_output_len``, ``runtime_top_k``, ``stop_words_list`` …). Every value is
checked here so that a bad request gets one clear error and never reaches the model.

Token ids at or above the vocabulary size select rows of the request's ``prompt_embedding_table``
(row id − vocab_size), as TensorRT-LLM's prompt tuning does. Without a table they embed as zero
vectors: what TensorRT-LLM's vocabulary-parallel embedding lookup computes for an id outside a
rank's rows (its tp=1 gather leaves such ids undefined), so workloads of random ids
(``benchmark_core_model.py … token-norm-dist``) are served rather than refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np


class RequestError(ValueError):
    """A request the model refuses; the message goes back to the client as the response error."""


# Inputs that only change beam search; at beam width 1 TensorRT-LLM ignores them as well.
BEAM_ONLY = frozenset({"len_penalty", "early_stopping", "beam_search_diversity_rate"})

# Every input this runtime honours.
HONOURED = frozenset({
    "input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list",
    "bad_words_list", "embedding_bias", "temperature", "runtime_top_k", "runtime_top_p",
    "runtime_top_p_min", "runtime_top_p_decay", "runtime_top_p_reset_ids", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "min_length", "random_seed", "return_log_probs",
    "return_context_logits", "return_generation_logits", "exclude_input_in_output", "streaming",
    "stop", "beam_width", "num_return_sequences", "return_perf_metrics", "return_num_input_tokens",
    "return_num_output_tokens", "prompt_embedding_table", "prompt_vocab_size", "decoder_input_ids",
    "decoder_input_lengths", "prompt_table_extra_ids", "lora_task_id", "lora_weights", "lora_config",
    "guided_decoding_guide_type", "guided_decoding_guide",
}) | BEAM_ONLY

# ``prompt_table_extra_ids`` only keys TensorRT-LLM's KV-cache reuse of prompt-table tokens: this runtime
# reuses no KV cache across requests, so the value cannot change a result. ``decoder_input_ids`` is the
# decoder prompt of encoder-decoder engines; for a decoder-only model tensorrtllm_backend's
# preprocessing sends one pad token per row, which is accepted (and longer decoder prompts refused).

# The guide types of TensorRT-LLM's GuidedDecodingParams (``guided_decoding_guide_type``); guided.py
# compiles them with xgrammar. Only ``json`` (any JSON) needs no ``guided_decoding_guide``.
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar", "structural_tag")

# Inputs renamed across backend versions: newer name → the name used here.
ALIASES = {"min_tokens": "min_length", "seed": "random_seed"}


@dataclass(frozen=True)
class Limits:
    """What the served model accepts."""

    vocab_size: int
    max_input_len: int
    max_seq_len: int
    hidden_size: int = 0  # checks prompt-table rows when known


@dataclass(frozen=True)
class Guide:
    """One row's guided-decoding guide, as sent: its type and text."""

    kind: str
    text: str = ""


@dataclass
class SamplingParams:
    """Per-sequence sampling parameters with TensorRT-LLM's defaults (greedy unless asked)."""

    top_k: int = 0
    top_p: float = 0.0
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_length: int = 1
    seed: int = 0
    top_p_min: float = 1e-6
    top_p_decay: float = 1.0
    top_p_reset_id: int | None = None

    @property
    def greedy(self) -> bool:
        # TensorRT-LLM: top_k = 0 and top_p = 0 means greedy; so does top_k = 1.
        return self.top_k == 1 or (self.top_k == 0 and self.top_p <= 0.0) or self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


@dataclass
class GenerationRequest:
    """One sequence to generate (one row of a Triton request's batch)."""

    prompt: list[int]
    max_new_tokens: int
    end_id: int | None = None
    pad_id: int | None = None
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    embedding_bias: np.ndarray | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    return_log_probs: bool = False
    return_context_logits: bool = False
    return_generation_logits: bool = False
    return_perf_metrics: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    # forge's log-prob outputs of the LLM-API layout (toplogprobs.py): alternatives per generated / prompt token
    top_logprobs: int | None = None
    prompt_logprobs: int | None = None
    exclude_input: bool = False
    streaming: bool = False
    batch_index: int = 0
    # rows selected by prompt ids ≥ the vocabulary size (``prompt_embedding_table``), [rows, hidden]
    prompt_table: np.ndarray | None = None
    # LoRA (see lora.py): the request's task id and adapter arrays, and the adapter they resolve to
    lora_task_id: int | None = None
    lora_weights: np.ndarray | None = None
    lora_config: np.ndarray | None = None
    lora: object | None = None
    # guided decoding: the row's guide and its compiled grammar (guided.Guides.prepare sets it)
    guide: Guide | None = None
    grammar: object | None = None


def _rows(tensors: Mapping[str, np.ndarray], name: str, batch: int) -> np.ndarray | None:
    """A per-row scalar input as a flat array of ``batch`` values (one value broadcasts)."""
    value = tensors.get(name)
    if value is None:
        return None
    flat = np.asarray(value).reshape(-1)
    if flat.size == batch:
        return flat
    if flat.size == 1:
        return np.repeat(flat, batch)
    raise RequestError(f"input {name!r} has {flat.size} values for a batch of {batch}; send one per row")


def _int(value) -> int:
    return int(np.asarray(value).item())


def word_list(value: np.ndarray | None, name: str) -> list[list[int]]:
    """Decode the ``[2, N]`` word-list format: flat token ids, then cumulative end offsets (-1 pads)."""
    if value is None:
        return []
    value = np.asarray(value)
    if value.size == 0:
        return []
    if value.ndim != 2 or value.shape[0] != 2:
        raise RequestError(f"input {name!r} must have shape [2, N] per row (ids, offsets), got {list(value.shape)}")
    ids, offsets = value[0].astype(np.int64).tolist(), value[1].astype(np.int64).tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if end < start or end > len(ids):
            raise RequestError(f"input {name!r} has an invalid offset {end} (ids has {len(ids)} entries)")
        if end > start:
            words.append(ids[start:end])
        start = end
    return words


def _nonzero(value: np.ndarray) -> bool:
    value = np.asarray(value)
    if value.size == 0:
        return False
    if value.dtype == object or value.dtype.kind in "SU":
        return any(bool(v) for v in value.reshape(-1))
    return bool(np.any(value != 0))


def is_stop(tensors: Mapping[str, np.ndarray]) -> bool:
    """Whether this is a TensorRT-LLM ``stop`` request (cancel the request with the same id)."""
    stop = tensors.get("stop")
    return stop is not None and np.asarray(stop).size > 0 and bool(np.asarray(stop).reshape(-1)[0])


def parse(tensors: Mapping[str, np.ndarray], limits: Limits, *, decoupled: bool,
          exclude_input: bool = False, warn: Callable[[str], None] = lambda message: None) -> list[GenerationRequest]:
    """Check one request's tensors and return one GenerationRequest per batch row."""
    tensors = {ALIASES.get(name, name): value for name, value in tensors.items()}
    for name, value in tensors.items():
        if name not in HONOURED and _nonzero(value):
            raise RequestError(f"input {name!r} is not supported by forge's python target; "
                               "leave it out or use the tensorrtllm target")
    if "input_ids" not in tensors:
        raise RequestError("input 'input_ids' is required")
    ids = np.asarray(tensors["input_ids"])
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2:
        raise RequestError(f"input 'input_ids' must be [batch, tokens], got shape {list(ids.shape)}")
    batch = ids.shape[0]
    if batch == 0:
        raise RequestError("input 'input_ids' holds no rows")

    lengths = _rows(tensors, "input_lengths", batch)
    output_len = _rows(tensors, "request_output_len", batch)
    if output_len is None:
        raise RequestError("input 'request_output_len' is required")
    values = {name: _rows(tensors, name, batch) for name in (
        "end_id", "pad_id", "temperature", "runtime_top_k", "runtime_top_p", "runtime_top_p_min",
        "runtime_top_p_decay", "runtime_top_p_reset_ids", "repetition_penalty", "presence_penalty",
        "frequency_penalty", "min_length", "random_seed", "return_log_probs", "return_context_logits",
        "return_generation_logits", "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens",
        "exclude_input_in_output", "streaming", "beam_width", "num_return_sequences")}

    _check_decoder_prompt(tensors, batch)
    tables, prompt_vocab = _prompt_tables(tensors, batch)
    lora_ids = _rows(tensors, "lora_task_id", batch)
    lora_weights, lora_config = _per_row(tensors, "lora_weights", batch), _per_row(tensors, "lora_config", batch)
    guides = _guides(tensors, batch)

    def get(name: str, row: int, default):
        column = values[name]
        return default if column is None else column[row]

    requests = []
    for row in range(batch):
        length = ids.shape[1] if lengths is None else _int(lengths[row])
        if length <= 0:
            raise RequestError("the prompt is empty (input_lengths is 0); send at least one token")
        if length > ids.shape[1]:
            raise RequestError(f"input_lengths {length} exceeds the {ids.shape[1]} tokens in input_ids")
        prompt = ids[row, :length].astype(np.int64)
        if prompt.min() < 0:
            raise RequestError(f"input_ids holds the negative token id {int(prompt.min())}")
        table = _row(tables, row, batch)
        if table is not None:
            table = table[: prompt_vocab[row]]
            if limits.hidden_size and table.shape[1] != limits.hidden_size:
                raise RequestError(f"prompt_embedding_table rows have {table.shape[1]} values; this model's "
                                   f"hidden size is {limits.hidden_size}")
            if prompt.max() >= limits.vocab_size + table.shape[0]:
                raise RequestError(f"input_ids holds token id {int(prompt.max())}; with a prompt table of "
                                   f"{table.shape[0]} rows ids must be below {limits.vocab_size + table.shape[0]}")
        if length > limits.max_input_len:
            raise RequestError(f"the prompt has {length} tokens, more than this model's max_input_len "
                               f"{limits.max_input_len}")
        new = _int(output_len[row])
        if new <= 0:
            raise RequestError(f"request_output_len must be at least 1, got {new}")
        if length + new > limits.max_seq_len:
            # TensorRT-LLM's engine shortens such a request, with a warning in the server log
            warn(f"prompt length + requested output tokens ({length} + {new}) exceeds the maximum sequence "
                 f"length ({limits.max_seq_len}); requested output tokens changed to {limits.max_seq_len - length}")
            new = limits.max_seq_len - length

        beam = _int(get("beam_width", row, 1))
        if beam not in (0, 1):
            raise RequestError(f"beam_width {beam} is not supported by forge's python target (beam width 1 only)")
        returns = _int(get("num_return_sequences", row, 1))
        if returns not in (0, 1):
            raise RequestError(f"num_return_sequences {returns} is not supported by forge's python target (1 only)")

        sampling = SamplingParams(
            top_k=_int(get("runtime_top_k", row, 0)),
            top_p=float(get("runtime_top_p", row, 0.0)),
            temperature=float(get("temperature", row, 1.0)),
            repetition_penalty=float(get("repetition_penalty", row, 1.0)),
            presence_penalty=float(get("presence_penalty", row, 0.0)),
            frequency_penalty=float(get("frequency_penalty", row, 0.0)),
            min_length=_int(get("min_length", row, 1)),
            seed=int(np.asarray(get("random_seed", row, 0)).astype(np.uint64).item()),
            top_p_min=float(get("runtime_top_p_min", row, 1e-6)),
            top_p_decay=float(get("runtime_top_p_decay", row, 1.0)),
        )
        reset = values["runtime_top_p_reset_ids"]
        if reset is not None and 0 <= _int(reset[row]) < limits.vocab_size:
            sampling.top_p_reset_id = _int(reset[row])
        _check_sampling(sampling)

        end_id = get("end_id", row, None)
        end_id = None if end_id is None or not 0 <= _int(end_id) < limits.vocab_size else _int(end_id)
        pad_id = get("pad_id", row, None)

        bias = tensors.get("embedding_bias")
        if bias is not None and np.asarray(bias).size:
            bias = np.asarray(bias, dtype=np.float32)
            bias = bias[row] if bias.ndim == 2 and bias.shape[0] == batch else bias.reshape(-1)
            if bias.size != limits.vocab_size:
                raise RequestError(f"embedding_bias has {bias.size} values; the vocabulary has {limits.vocab_size}")
        else:
            bias = None

        def words(name: str) -> list[list[int]]:
            value = tensors.get(name)
            if value is None:
                return []
            value = np.asarray(value)
            if value.ndim == 3:
                value = value[row if value.shape[0] == batch else 0]
            return word_list(value, name)

        streaming = bool(get("streaming", row, False))
        if streaming and not decoupled:
            raise RequestError("streaming needs a decoupled model; rebuild the repository with --decoupled")
        requests.append(GenerationRequest(
            prompt=prompt.tolist(), max_new_tokens=new, end_id=end_id,
            pad_id=None if pad_id is None else _int(pad_id),
            stop_words=words("stop_words_list"), bad_words=words("bad_words_list"),
            embedding_bias=bias, sampling=sampling,
            return_log_probs=bool(get("return_log_probs", row, False)),
            return_context_logits=bool(get("return_context_logits", row, False)),
            return_generation_logits=bool(get("return_generation_logits", row, False)),
            return_perf_metrics=bool(get("return_perf_metrics", row, False)),
            return_num_input_tokens=bool(get("return_num_input_tokens", row, False)),
            return_num_output_tokens=bool(get("return_num_output_tokens", row, False)),
            exclude_input=bool(get("exclude_input_in_output", row, exclude_input)),
            streaming=streaming, batch_index=row, prompt_table=table,
            lora_task_id=None if lora_ids is None else int(np.asarray(lora_ids[row]).astype(np.uint64).item()),
            lora_weights=lora_weights(row), lora_config=lora_config(row), guide=guides[row]))
    return requests


def _text(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="strict")
    return "" if value is None else str(value)


def _guides(tensors: Mapping[str, np.ndarray], batch: int) -> list[Guide | None]:
    """Each row's ``guided_decoding_guide_type`` / ``guided_decoding_guide`` (an empty type: no guide)."""
    kinds, texts = _rows(tensors, "guided_decoding_guide_type", batch), _rows(tensors, "guided_decoding_guide", batch)
    if kinds is None and texts is None:
        return [None] * batch
    try:
        kinds = [""] * batch if kinds is None else [_text(k).strip().lower() for k in kinds]
        texts = [""] * batch if texts is None else [_text(t) for t in texts]
    except UnicodeDecodeError:
        raise RequestError("guided_decoding_guide_type and guided_decoding_guide must be UTF-8 text") from None
    guides: list[Guide | None] = []
    for kind, text in zip(kinds, texts):
        if not kind:
            if text.strip():
                raise RequestError("input 'guided_decoding_guide' is not supported without "
                                   f"'guided_decoding_guide_type' (one of {', '.join(GUIDE_TYPES)})")
            guides.append(None)
        elif kind not in GUIDE_TYPES:
            raise RequestError(f"guided_decoding_guide_type {kind!r} is not one of {', '.join(GUIDE_TYPES)}")
        elif not text.strip() and kind != "json":
            raise RequestError(f"guided_decoding_guide_type {kind!r} needs a guided_decoding_guide")
        else:
            guides.append(Guide(kind, text))
    return guides


def _per_row(tensors: Mapping[str, np.ndarray], name: str, batch: int) -> Callable[[int], np.ndarray | None]:
    """A [batch, …] input's row (one row is shared by every row); absent or empty → None."""
    value = tensors.get(name)
    if value is None or np.asarray(value).size == 0:
        return lambda row: None
    value = np.asarray(value)
    if value.ndim == 3 and value.shape[0] not in (1, batch):
        raise RequestError(f"input {name!r} has {value.shape[0]} rows for a batch of {batch}")
    if value.ndim == 3 and value.shape[0] == batch:
        return lambda row: value[row]
    return lambda row: value


def _prompt_tables(tensors: Mapping[str, np.ndarray], batch: int) -> tuple[np.ndarray | None, list[int]]:
    """``prompt_embedding_table`` as [batch or 1, rows, hidden] and each row's ``prompt_vocab_size``."""
    table = tensors.get("prompt_embedding_table")
    if table is None or np.asarray(table).size == 0:
        return None, [0] * batch
    table = np.asarray(table, dtype=np.float32)
    if table.ndim == 2:
        table = table[None]
    if table.ndim != 3 or table.shape[0] not in (1, batch):
        raise RequestError(f"input 'prompt_embedding_table' must be [batch, rows, hidden], got {list(table.shape)}")
    sizes = _rows(tensors, "prompt_vocab_size", batch)
    rows = [table.shape[1]] * batch if sizes is None else [_int(v) for v in sizes]
    if any(r <= 0 for r in rows):
        raise RequestError("prompt_vocab_size must be at least 1 when a prompt_embedding_table is sent")
    return table, rows


def _row(tables: np.ndarray | None, row: int, batch: int) -> np.ndarray | None:
    if tables is None:
        return None
    return tables[row if tables.shape[0] == batch else 0]


def _check_decoder_prompt(tensors: Mapping[str, np.ndarray], batch: int) -> None:
    """Refuse a real decoder prompt (encoder-decoder engines only); accept the one-token placeholder."""
    ids = tensors.get("decoder_input_ids")
    if ids is None or np.asarray(ids).size == 0:
        return
    lengths = _rows(tensors, "decoder_input_lengths", batch)
    width = np.asarray(ids).reshape(batch, -1).shape[1] if np.asarray(ids).size % batch == 0 else 2
    longest = width if lengths is None else max(_int(v) for v in lengths)
    if longest > 1:
        raise RequestError("decoder_input_ids is the decoder prompt of encoder-decoder models; this decoder-only "
                           "model takes its prompt in input_ids (send at most the one-token placeholder)")


def _check_sampling(s: SamplingParams) -> None:
    if s.top_k < 0:
        raise RequestError(f"runtime_top_k must be ≥ 0, got {s.top_k}")
    if not 0.0 <= s.top_p <= 1.0:
        raise RequestError(f"runtime_top_p must be in [0, 1], got {s.top_p}")
    if s.temperature < 0.0 or not np.isfinite(s.temperature):
        raise RequestError(f"temperature must be ≥ 0, got {s.temperature}")
    if s.repetition_penalty <= 0.0:
        raise RequestError(f"repetition_penalty must be > 0, got {s.repetition_penalty}")
    if s.min_length < 0:
        raise RequestError(f"min_length must be ≥ 0, got {s.min_length}")
    if not 0.0 < s.top_p_decay <= 1.0:
        raise RequestError(f"runtime_top_p_decay must be in (0, 1], got {s.top_p_decay}")
    if not 0.0 < s.top_p_min <= 1.0:
        raise RequestError(f"runtime_top_p_min must be in (0, 1], got {s.top_p_min}")
