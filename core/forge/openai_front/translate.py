"""OpenAI requests → what the served generator takes: the prompt (chat template on the server), the tensors
of the ensemble's interface, the grammar of tools and structured output, and stop strings in text.
"""

from __future__ import annotations

import base64
import binascii
import functools
import inspect
import io
import json
import re
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..clients.inference import (EXCLUDE_INPUT, GUIDE, GUIDE_TYPE, MAX_TOKENS, SAMPLING_INPUTS, STREAM, TRITON_TO_NUMPY,
                                 first_input)
from .catalog import LLAVA_TURN, Catalog, TextModel
from .protocol import APIError, ChatRequest, Message, _ChatTemplate, _Sampling, is_unicode, valid_text
from .vllm_interface import fold, is_vllm

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.DOTALL)
# forge's additions to the LLM-API interface (forge_llmapi.EXTENSION_INPUTS), which both targets declare
PROMPT_IDS, LOGPROBS, PROMPT_LOGPROBS = "prompt_token_ids", "sampling_param_logprobs", "sampling_param_prompt_logprobs"
#: a token-level request parameter → the input it is sent in, the output it is answered in, and what it asks for
TOKEN_LEVEL = {"prompt": (PROMPT_IDS, None, "token-id prompts"),
               "logprobs": (LOGPROBS, "logprobs", "log-probabilities"),
               "echo": (PROMPT_LOGPROBS, "prompt_logprobs", "the prompt's log-probs")}


@dataclass
class Generation:
    """One generation the front asks of the ensemble."""

    prompt: str
    max_tokens: int
    prompt_tokens: int | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # served input → value
    stops: list[str] = field(default_factory=list)
    guide: tuple[str, str] | None = None
    image: bytes | None = None
    tools: str | None = None  # "required" / "auto": the answer may be a tool call
    include_stop: bool = False  # the stop string that ended the answer stays in it
    prompt_ids: list[int] | None = None  # sent as token ids (token-id prompts, and whenever log-probs are asked)
    logprobs: int | None = None  # log-probs of the generated tokens, with this many alternatives each
    prompt_logprobs: int | None = None  # and of the prompt's tokens (an echo with log-probs)
    answer: bool = True  # False: max_tokens 0, the prompt only (one token is generated and left out)

    def varied(self, index: int, seeded: bool) -> "Generation":
        """The ``index``-th of ``n`` choices of one request: another seed when it samples (``seed`` + index if the
        request set one, else a fresh one)."""
        name = next((n for n in SAMPLING_INPUTS["seed"] if n in self.sampling), None)
        if index == 0 or name is None or any(self.sampling.get(k) == 1 for k in SAMPLING_INPUTS["top_k"]):
            return self  # greedy: every choice is the same answer
        seed = (int(self.sampling[name]) + index) % 2**64 if seeded else secrets.randbits(63)
        return replace(self, sampling={**self.sampling, name: seed})


# -- prompts ---------------------------------------------------------------------------------------

def _image_bytes(url: str) -> bytes:
    if url.startswith(("http://", "https://")):
        raise APIError(400, "image_url: this server fetches nothing from the network; send the image inline as a "
                            "data:image/...;base64,... URL", param="messages", code="image_url_not_supported")
    match = _DATA_URL.match(url)
    if match is None:
        raise APIError(400, "image_url must be a data:image/...;base64,... URL", param="messages",
                       code="invalid_image_url")
    try:
        data = base64.b64decode(match["data"], validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "image_url: the data URL is not valid base64", param="messages",
                       code="invalid_image_url") from None
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except ImportError:
        pass  # the server's preprocessing decodes it and says what is wrong
    except Exception:  # noqa: BLE001 - PIL raises many kinds for undecodable bytes
        raise APIError(400, "image_url: the data is not a decodable image", param="messages",
                       code="invalid_image") from None
    return data


def _content(message: Message, placeholder: str | None, images: list[bytes]) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    pieces = []
    for part in message.content:
        if part.type in ("text", "input_text"):
            pieces.append(part.text or "")
        elif part.image_url is not None:
            if placeholder is None:
                raise APIError(400, "this model takes no images (it is not a vision-language repository)",
                               param="messages", code="images_not_supported")
            images.append(_image_bytes(part.image_url.url))
            pieces.append(placeholder + "\n")
    return "".join(pieces)


def _template_message(message: Message, content: str) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": content}
    if message.name:
        turn["name"] = message.name
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                arguments = call.function.arguments
            calls.append({"id": call.id, "type": "function",
                          "function": {"name": call.function.name, "arguments": arguments}})
        turn["tool_calls"] = calls
    return turn


@functools.lru_cache(maxsize=8)
def _template_arguments(kind: type) -> frozenset[str]:
    """The arguments of ``apply_chat_template`` itself: not template variables, so not chat_template_kwargs."""
    parameters = inspect.signature(kind.apply_chat_template).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is not p.VAR_KEYWORD and p.name != "self")


def _template_kwargs(tokenizer, request: _ChatTemplate) -> dict[str, Any]:
    kwargs = dict(request.chat_template_kwargs or {})
    taken = sorted(set(kwargs) & _template_arguments(type(tokenizer)))
    if taken:
        hint = {"add_generation_prompt": " (set it as the request's own field)",
                "continue_final_message": " (set it as the request's own field)", "tools": " (send tools)"}
        raise APIError(400, f"chat_template_kwargs: {taken[0]!r} is an argument of the chat template call, not a "
                            f"template variable{hint.get(taken[0], '')}", param="chat_template_kwargs")
    return kwargs


def chat_prompt(catalog: Catalog, request: _ChatTemplate) -> tuple[str, bytes | None]:
    """The templated prompt of chat messages (a chat request, or /tokenize's) and its image, if any."""
    images: list[bytes] = []
    turns = [_template_message(m, _content(m, catalog.image_placeholder, images)) for m in request.messages]
    if len(images) > 1:
        raise APIError(400, f"this model takes one image per request, got {len(images)}", param="messages",
                       code="too_many_images")
    tokenizer = catalog.generator.tokenizer
    if getattr(tokenizer, "chat_template", None):
        tools = None
        if request.tools and getattr(request, "tool_choice", None) != "none":
            tools = [t.model_dump(exclude_none=True) for t in request.tools]
        kwargs = _template_kwargs(tokenizer, request)
        try:
            prompt = tokenizer.apply_chat_template(turns, tools=tools, tokenize=False,
                                                   add_generation_prompt=request.add_generation_prompt,
                                                   continue_final_message=request.continue_final_message, **kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja raises whatever the template's author raised
            raise APIError(400, f"the model's chat template refused these messages: {exc}", param="messages",
                           code="chat_template_error") from None
    elif catalog.image_placeholder is not None:
        for name, neutral in (("add_generation_prompt", True), ("continue_final_message", False),
                              ("chat_template_kwargs", None)):
            if getattr(request, name) != neutral:
                raise APIError(400, f"{name} is not supported by this model: it has no chat template, only "
                                    "LLaVA-1.5's fixed turn", param=name, code="unsupported_parameter")
        text = "\n".join(t["content"] for t in turns if t["role"] in ("system", "user") and t["content"])
        prompt = LLAVA_TURN.format(user=text)
    else:
        raise APIError(400, f"model {catalog.model_id!r} has no chat template (its tokenizer defines none); "
                            "send the prompt to /v1/completions", param="messages", code="no_chat_template")
    return valid_text(prompt, "messages"), (images[0] if images else None)


def echoed(request: ChatRequest) -> str:
    """What vLLM's ``echo`` puts before a chat answer: the last message's text when it is in the answer's role
    (the assistant's, or any role without a generation prompt)."""
    last = request.messages[-1]
    if not request.echo or (request.add_generation_prompt and last.role != "assistant"):
        return ""
    if last.content is None or isinstance(last.content, str):
        return last.content or ""
    return "\n".join(part.text or "" for part in last.content if part.type in ("text", "input_text"))


# -- structured output and tools -------------------------------------------------------------------

def check_schema(schema: Any, param: str) -> None:
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: a JSON schema must be an object", param=param, code="invalid_schema")
    try:
        import jsonschema

        jsonschema.validators.validator_for(schema).check_schema(schema)
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001 - jsonschema's SchemaError and friends
        message = getattr(exc, "message", str(exc))
        raise APIError(400, f"{param} is not a valid JSON schema: {message}", param=param,
                       code="invalid_schema") from None


def _tool_schema(tool) -> dict[str, Any]:
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    check_schema(parameters, f"tools[{tool.function.name}].function.parameters")
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def chat_guide(request: ChatRequest) -> tuple[tuple[str, str] | None, str | None]:
    """The grammar a chat request needs (guide type, guide), and whether tool calls are expected."""
    choice = request.tool_choice
    if request.tools:
        names = [t.function.name for t in request.tools]
        if len(set(names)) != len(names):
            raise APIError(400, "tools: function names must be unique", param="tools")
        if choice is None:
            choice = "auto"
        if not isinstance(choice, str):
            chosen = [t for t in request.tools if t.function.name == choice.function.name]
            if not chosen:
                raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not in tools",
                               param="tool_choice")
            return ("json_schema", json.dumps(_tool_schema(chosen[0]))), "required"
        if choice == "required":
            schemas = [_tool_schema(t) for t in request.tools]
            schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
            return ("json_schema", json.dumps(schema)), "required"
        if choice == "auto":
            for tool in request.tools:
                _tool_schema(tool)
            return _response_guide(request), "auto"
        return _response_guide(request), None
    if choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    return _response_guide(request), None


def _response_guide(request: ChatRequest) -> tuple[str, str] | None:
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ("json_schema", json.dumps({"type": "object"}))
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
    check_schema(fmt.json_schema.schema_, "response_format.json_schema.schema")
    return ("json_schema", json.dumps(fmt.json_schema.schema_))


_TOOL_TAG = re.compile(r"<tool_call>\s*(?P<body>.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def tool_calls(text: str, mode: str | None) -> list[dict[str, Any]] | None:
    """Tool calls in a generated answer: the constrained JSON object, or Hermes-style ``<tool_call>`` tags."""
    if mode is None:
        return None
    bodies = [m["body"] for m in _TOOL_TAG.finditer(text)] or [text.strip()]
    calls = []
    for body in bodies:
        try:
            value = json.loads(body)
        except ValueError:
            continue
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not is_unicode(item["name"]):
                continue
            arguments = item.get("arguments", item.get("parameters", {}))
            calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                          "function": {"name": item["name"], "arguments": json.dumps(arguments)}})
    return calls or None


# -- the ensemble's tensors ------------------------------------------------------------------------

def sampling(request: _Sampling) -> dict[str, Any]:
    """OpenAI sampling → the ensemble's flags (TensorRT-LLM semantics: top_k 1 is greedy)."""
    values: dict[str, Any] = {}
    temperature = 1.0 if request.temperature is None else request.temperature
    # TensorRT-LLM's seeds are UINT64: a negative seed is sent as the same 64 bits
    seed = None if request.seed is None else request.seed & (2**64 - 1)
    if temperature == 0.0:
        values["top_k"] = 1
    else:
        values["temperature"] = temperature
        values["top_p"] = 1.0 if request.top_p is None else request.top_p
        # without a seed, OpenAI samples afresh each time; the backend's default seed (0) would repeat itself
        values["seed"] = seed if seed is not None else secrets.randbits(63)
    if seed is not None:
        values["seed"] = seed
    if request.presence_penalty:
        values["presence_penalty"] = request.presence_penalty
    if request.frequency_penalty:
        values["frequency_penalty"] = request.frequency_penalty
    return values


def stops(request: _Sampling) -> list[str]:
    """The request's stop strings, checked to be valid Unicode."""
    return [valid_text(s, "stop") for s in request.stops()]


def max_tokens(catalog: Catalog, asked: int | None, prompt_tokens: int | None, default: int | None) -> int:
    """The tokens to generate: as asked (refused past the context), else what the context leaves."""
    limit = catalog.max_seq_len
    if prompt_tokens is not None and catalog.max_input_len and prompt_tokens > catalog.max_input_len:
        raise APIError(400, f"the prompt has {prompt_tokens} tokens; this model accepts at most "
                            f"{catalog.max_input_len} input tokens (max_input_len)", param="messages",
                       code="context_length_exceeded")
    if limit and prompt_tokens is not None:
        room = limit - prompt_tokens
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_tokens} tokens; this model's context is {limit} tokens "
                                "(max_seq_len), which leaves no room to generate", param="messages",
                           code="context_length_exceeded")
        if asked is not None and asked > room:
            raise APIError(400, f"this model's context is {limit} tokens (max_seq_len); the prompt has "
                                f"{prompt_tokens}, so at most {room} can be generated, and max_tokens asks for "
                                f"{asked}", param="max_tokens", code="context_length_exceeded")
        return asked if asked is not None else (room if default is None else min(default, room))
    return asked if asked is not None else (default or 256)


def tensors(model: TextModel, generation: Generation, *, stream: bool) -> dict[str, np.ndarray]:
    """The request's tensors, typed by the served model's own config."""
    inputs = model.inputs
    payload: dict[str, Any] = {"text_input": generation.prompt, first_input(inputs, MAX_TOKENS): generation.max_tokens}
    if generation.logprobs is not None:
        token_level(model, "logprobs")
        payload[LOGPROBS] = generation.logprobs
    if generation.prompt_logprobs is not None:
        token_level(model, "echo")
        payload[PROMPT_LOGPROBS] = generation.prompt_logprobs
    if generation.prompt_ids is not None:
        token_level(model, "prompt")
        payload["text_input"], payload[PROMPT_IDS] = "", generation.prompt_ids
    if generation.stops and "stop_words" in inputs.inputs:
        payload["stop_words"] = list(generation.stops)
    elif generation.stops and "sampling_param_stop" in inputs.inputs:
        payload["sampling_param_stop"] = list(generation.stops)
    stream_input = first_input(inputs, STREAM)
    if stream and inputs.decoupled and stream_input is not None:
        payload[stream_input] = True
    for flag in (first_input(inputs, EXCLUDE_INPUT), "return_num_input_tokens", "return_num_output_tokens",
                 "return_finish_reason"):
        if flag in inputs.inputs:
            payload[flag] = True
    if generation.image is not None:
        if "image" not in inputs.inputs:
            raise APIError(400, "this model takes no images", param="messages", code="images_not_supported")
        payload["image"] = generation.image
    if generation.guide is not None:
        if GUIDE_TYPE not in inputs.inputs:
            raise APIError(400, "tools and response_format need guided decoding, which this repository's backend "
                                "profile lacks (the engine layout of tensorrtllm_backend v0.19.0 … v1.2.1 has it; "
                                "the LLM-API model does not)", param="response_format",
                           code="guided_decoding_unavailable")
        payload[GUIDE_TYPE], payload[GUIDE] = generation.guide
    payload.update(generation.sampling)
    for name, value in payload.items():
        _fits(inputs.inputs[name][0], name, value)
    payload = fold(inputs, payload, stream=stream)  # a vLLM-backend model: its sampling_param_* as one JSON
    return {name: inputs.array(name, value) for name, value in payload.items()}


def token_level(model: TextModel, param: str) -> None:
    """A 400 naming the served model when its config declares no input for ``param`` (``prompt``, ``logprobs``,
    ``echo``) or no output answering it, whichever target built it."""
    given, answered, what = TOKEN_LEVEL.get(param, TOKEN_LEVEL["echo"])
    if given not in model.inputs.inputs or (answered is not None and answered not in model.inputs.outputs):
        served = ("has the interface of Triton's vLLM backend, which takes text prompts and answers the log-probs "
                  "of generated tokens only" if is_vllm(model.inputs) else "takes text and answers text only")
        raise APIError(400, f"{param}: the served model {model.name!r} {served}, so {what} are not available; the "
                            "LLM-API layout's tensorrt_llm model (the newest --backend-version, --target tensorrtllm "
                            "or python) serves them", param=param, code="unsupported_parameter")


def _fits(dtype: str, name: str, value: Any) -> None:
    """A 400, not an overflow, for an integer the served input's type cannot hold."""
    kind = TRITON_TO_NUMPY.get(dtype)
    if kind is None or not np.issubdtype(kind, np.integer):
        return
    bounds = np.iinfo(kind)
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(item, (int, np.integer)) and not bounds.min <= int(item) <= bounds.max:
            raise APIError(400, f"{name}: {item} does not fit the served model's input ({dtype})", param=name,
                           code="invalid_value")


# -- stop strings ----------------------------------------------------------------------------------

class StopText:
    """Cuts generated text at the first stop string (after it, with ``include``), holding back a tail that may
    begin one."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops = stops
        self.include = include
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text that can be sent now."""
        if self.stopped:
            return ""
        self.text += piece
        hits = [(i, len(s)) for i, s in ((self.text.find(s, max(0, self.sent - len(s) + 1)), s) for s in self.stops)
                if i >= 0]
        if hits:
            self.stopped = True
            at, length = min(hits)
            cut = at + length if self.include else at
            out, self.sent = self.text[self.sent:cut], cut
            self.text = self.text[:cut]
            return out
        ready = max(self.sent, len(self.text) - self.hold) if self.stops else len(self.text)
        out, self.sent = self.text[self.sent:ready], ready
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
