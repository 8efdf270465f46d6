"""The OpenAI API's response objects (pydantic): what every route answers, and what ``/openapi.json`` shows.

Each object has OpenAI's keys in OpenAI's order. A key OpenAI writes as ``null`` is ``None`` here and
always sent; a key OpenAI leaves out unless it applies (``tool_calls`` of an answer without calls, a
model card's ``parent``, a chunk's ``usage`` unless ``stream_options.include_usage``) is listed in
``OPTIONAL`` and sent only when it was given.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_serializer


class _Answer(BaseModel):
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _given(self, handler):
        data = handler(self)
        for name in self.OPTIONAL:
            if name not in self.model_fields_set:
                data.pop(name, None)
        return data


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int | None, completion: int | None) -> "Usage | None":
        """The usage of a generation, or ``None`` where a count is unknown (not reported as zero)."""
        if prompt is None or completion is None:
            return None
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    @classmethod
    def total(cls, usages: "list[Usage | None]") -> "Usage | None":
        """Several generations' usage together (``None`` where one of them is unknown)."""
        if any(u is None for u in usages):
            return None
        return cls.of(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages))


# -- models -----------------------------------------------------------------------------------------

class ModelCard(_Answer):
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"parent", "root"})
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "forge"
    parent: str | None = None  # an adapter's base model
    root: str | None = None
    max_model_len: int | None = None  # the longest prompt and answer together (vLLM's key)


class ModelList(_Answer):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- chat completions -------------------------------------------------------------------------------

class CalledFunction(_Answer):
    name: str
    arguments: str  # JSON text


class ToolCall(_Answer):
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"index"})
    index: int | None = None  # in a chunk's delta only
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(_Answer):
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None


class TopLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Answer):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None = None


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(_Answer):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage | None


class Delta(_Answer):
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"role", "content", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChunkChoice(_Answer):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Answer):
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None  # the last chunk's, with stream_options.include_usage


# -- completions ------------------------------------------------------------------------------------

class CompletionLogprobs(_Answer):
    """The legacy completions shape: a list per token, the echoed prompt's first."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Answer):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(_Answer):
    """A ``text_completion`` object: the whole answer, or one streamed event of it."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


# -- embeddings -------------------------------------------------------------------------------------

class EmbeddingUsage(_Answer):
    prompt_tokens: int
    total_tokens: int


class Embedding(_Answer):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class EmbeddingList(_Answer):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage | None


# -- vLLM's utility endpoints ----------------------------------------------------------------------

class Tokenized(_Answer):
    """``POST /tokenize``: the token ids of a prompt, or of chat messages templated as a chat request is."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"token_strs"})
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class Detokenized(_Answer):
    """``POST /detokenize``: the text of token ids."""

    prompt: str


class TokenizerInfo(_Answer):
    """``GET /tokenizer_info``: the served tokenizer's configuration, as its tokenizer_config.json holds it
    (file paths left out), its class, and its chat template."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    model_max_length: int | None = None
    chat_template: str | dict[str, str] | None = None  # one template, or several by name


class Version(_Answer):
    version: str


# -- the error shape --------------------------------------------------------------------------------

class ErrorDetail(_Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Answer):
    error: ErrorDetail
