"""The OpenAI API's request bodies (pydantic) and its error shape.

Fields OpenAI documents but forge cannot honour are accepted only at their neutral value and refused
with 400 otherwise (``unsupported``); fields OpenAI itself ignores or keeps for its own bookkeeping
(``user``, ``metadata``, ``store``, ``service_tier``) are accepted and ignored. Anything else unknown is
refused with 400, as OpenAI refuses an unrecognized request argument.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: accepted and ignored, as OpenAI's own API treats them (bookkeeping, not generation)
IGNORED = ("user", "metadata", "store", "service_tier")


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 500: "server_error"}

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


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


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


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
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


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
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


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=5)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value


class EmbeddingRequest(_Strict):
    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None


def unsupported(request: BaseModel) -> None:
    """Refuse OpenAI parameters that forge accepts by name but cannot honour (400 naming the parameter)."""
    def refuse(param: str, why: str) -> None:
        raise APIError(400, f"{param} is not supported by this server: {why}", param=param, code="unsupported_parameter")

    if getattr(request, "n", 1) != 1:
        refuse("n", "it generates one choice per request (n must be 1)")
    if getattr(request, "logit_bias", None):
        refuse("logit_bias", "token-id biases are not passed to the model")
    if isinstance(request, ChatRequest):
        if request.logprobs or request.top_logprobs:
            refuse("logprobs", "the served ensemble returns text, not the token ids that log-probabilities belong to")
        for name in ("modalities", "audio", "prediction", "reasoning_effort", "web_search_options"):
            if getattr(request, name) is not None:
                refuse(name, "text generation only")
        if request.functions is not None or request.function_call is not None:
            refuse("functions", "use tools and tool_choice")
    if isinstance(request, CompletionRequest):
        if request.logprobs:
            refuse("logprobs", "the served ensemble returns text, not the token ids that log-probabilities belong to")
        if request.best_of not in (None, 1):
            refuse("best_of", "it generates one choice per request")
        if request.suffix:
            refuse("suffix", "insertion (fill-in-the-middle) is not supported")
