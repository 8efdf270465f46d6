"""The OpenAI API's request bodies (pydantic), vLLM's extensions of them and its utility requests, and the
error shape.

Fields OpenAI documents but forge cannot honour are accepted only at their neutral value and refused
with 400 otherwise (``unsupported``); fields OpenAI itself ignores or keeps for its own bookkeeping
(``user``, ``metadata``, ``store``, ``service_tier``) are accepted and ignored. vLLM's sampling extensions
(``top_k``, ``min_tokens``, ``stop_token_ids`` …) are accepted by name; ``extensions`` maps each onto the
served model or refuses it. Anything else unknown is refused with 400, as OpenAI refuses an unrecognized
request argument. Numbers are bounded here (no integer reaches a tensor it does not fit, no float is NaN or
infinite), so a hostile value is a 400, never a 500.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

#: accepted and ignored, as OpenAI's own API treats them (bookkeeping, not generation)
IGNORED = ("user", "metadata", "store", "service_tier")
INT32_MAX = 2**31 - 1  # token budgets and ids travel as INT32 tensors
INT64 = (-2**63, 2**63 - 1)  # seed and priority, as vLLM bounds them (a C long)


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 500: "server_error",
             502: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def is_unicode(text: str) -> bool:
    """Whether ``text`` can go out as UTF-8 (JSON's ``"\\ud800"`` parses to a string that cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def valid_text(text: str, param: str) -> str:
    """``text`` when it is valid Unicode; a lone UTF-16 surrogate is a 400."""
    if not is_unicode(text):
        raise APIError(400, f"{param} is not valid Unicode: it holds a lone UTF-16 surrogate", param=param,
                       code="invalid_unicode")
    return text


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


class ImageURL(_Strict):
    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class ContentPart(_Strict):
    type: Literal["text", "image_url", "input_text"]
    text: str | None = None
    image_url: ImageURL | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])
    stop: Union[str, list[str], None] = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's sampling extensions, at vLLM's defaults (``extensions`` maps or refuses each)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    length_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(default=None, max_length=1024)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    priority: int = Field(default=0, ge=INT64[0], le=INT64[1])

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, value):
        for token, bias in (value or {}).items():
            if not token.isdigit() or int(token) > INT32_MAX:
                raise ValueError(f"keys must be token ids, got {token[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        if isinstance(value, list):
            if len(value) > 4:
                raise ValueError("at most 4 stop sequences")
            if any(not s for s in value):
                raise ValueError("stop sequences must not be empty")
        elif value == "":
            raise ValueError("a stop sequence must not be empty")
        return value

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class _ChatTemplate(_Strict):
    """What the chat template is applied to, and how (vLLM's names and defaults)."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("continue_final_message")
    @classmethod
    def _one_ending(cls, value, info: ValidationInfo):
        if value and info.data.get("add_generation_prompt"):
            raise ValueError("cannot be true with add_generation_prompt (set add_generation_prompt: false)")
        return value


class ChatRequest(_Sampling, _ChatTemplate):
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False  # vLLM: the answer starts with the last message's content
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # OpenAI parameters forge cannot honour: refused when set (see ``unsupported``)
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None


TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: int | None = Field(default=None, ge=0, le=INT32_MAX)  # 0: the prompt only (with echo: scored)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and (not value or any(isinstance(v, list) and not v for v in value)):
            raise ValueError("prompt must not be an empty list")
        return value

    def prompts(self) -> list[str | list[int]]:
        """One prompt per choice group: a text, or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class EmbeddingRequest(_Strict):
    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=INT32_MAX)
    user: str | None = None


# -- vLLM's utility requests ----------------------------------------------------------------------

class TokenizePrompt(_Strict):
    """``POST /tokenize`` of a text (vLLM's TokenizeCompletionRequest)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None  # None: as the served preprocessing tokenizes (what usage counts)
    return_token_strs: bool = False


class TokenizeChat(_ChatTemplate):
    """``POST /tokenize`` of chat messages, templated as a chat request is (vLLM's TokenizeChatRequest)."""

    model: str | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]]


def unsupported(request: BaseModel) -> None:
    """Refuse OpenAI parameters that forge accepts by name but cannot honour (400 naming the parameter)."""
    def refuse(param: str, why: str) -> None:
        raise APIError(400, f"{param} is not supported by this server: {why}", param=param,
                       code="unsupported_parameter")

    if getattr(request, "logit_bias", None):
        refuse("logit_bias", "token-id biases are not passed to the model")
    if isinstance(request, ChatRequest):
        if request.top_logprobs and not request.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        for name in ("modalities", "audio", "prediction", "reasoning_effort", "web_search_options"):
            if getattr(request, name) is not None:
                refuse(name, "text generation only")
        if request.functions is not None or request.function_call is not None:
            refuse("functions", "use tools and tool_choice")
    if isinstance(request, CompletionRequest):
        if request.best_of not in (None, 1, request.n):
            refuse("best_of", "it returns every sequence it generates (best_of, when set, must equal n)")
        if request.suffix:
            refuse("suffix", "insertion (fill-in-the-middle) is not supported")
