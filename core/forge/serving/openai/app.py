"""The OpenAI API routes (FastAPI): models, chat completions, completions, embeddings, health.

Every route answers OpenAI's error shape; generation goes to the served ensemble through
:class:`~forge.serving.openai.triton.Triton`, so the same front serves every target.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import threading
import time
from contextlib import aclosing
from typing import Any, AsyncIterator

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ...errors import UsageError
from ..lora import UNKNOWN_TASK, LoraRequests, ServedAdapter
from . import requests as rq
from .catalog import Catalog, TextModel, model_card
from .protocol import (APIError, ChatRequest, CompletionRequest, EmbeddingRequest, unsupported)
from .triton import Triton, first_int, strings


class Front:
    """State shared by the routes: the catalog, the Triton client, the adapters already sent."""

    def __init__(self, catalog: Catalog, grpc_url: str, api_key: str | None = None):
        self.catalog = catalog
        self.grpc_url = grpc_url
        self.api_key = api_key
        self.triton: Triton | None = None
        self.draining = False  # forge serve is stopping: new API requests get 503, those in flight go on
        self.in_flight = 0  # API requests whose response (a stream: its last event) is not sent yet
        self.idle = threading.Event()
        self.idle.set()

    def models_behind(self) -> list[str]:
        names = []
        for model in (self.catalog.generator, self.catalog.embedder):
            if model is not None:
                names += [model.name, *model.inputs.steps]
        return sorted(set(names))

    def resolve(self, model_id: str, *, param: str = "model") -> ServedAdapter | None:
        if model_id == self.catalog.model_id:
            return None
        if model_id in self.catalog.adapters:
            return self.catalog.adapters[model_id]
        raise APIError(404, f"the model {model_id!r} does not exist; this server has: "
                            f"{', '.join(self.catalog.ids())}", param=param, code="model_not_found")

    def generator(self) -> TextModel:
        if self.catalog.generator is None:
            raise APIError(400, f"model {self.catalog.model_id!r} generates no text (it is an embedding model); "
                                "use /v1/embeddings", param="model", code="wrong_endpoint")
        return self.catalog.generator

    def lora_tensors(self, adapter: ServedAdapter | None, with_weights: bool) -> dict[str, np.ndarray]:
        """The adapter's tensors, as tensorrtllm_backend's cache protocol sends them (serving.lora)."""
        if adapter is None:
            return {}
        try:
            return LoraRequests(self.generator().inputs).tensors(adapter, with_weights)
        except UsageError as exc:
            raise APIError(400, str(exc), param="model") from None


# -- one generation, streamed as text pieces ---------------------------------------------------------

class Outcome:
    """What a finished generation reports besides its text."""

    def __init__(self):
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.finish_reason = "stop"


async def generate(front: Front, generation: rq.Generation, adapter: ServedAdapter | None, *, stream: bool,
                   outcome: Outcome, request_id: str) -> AsyncIterator[str]:
    """The generated text in pieces (one piece when the model is not decoupled), stop strings applied."""
    model = front.generator()
    tensors = rq.tensors(model, generation, stream=stream)
    echoes = "exclude_input_in_output" not in model.inputs.inputs  # older profiles: the prompt comes back too
    stop = rq.StopText(generation.stops)
    texts: list[str] = []
    for attempt in (0, 1):
        first = adapter is not None and attempt == 1
        extra = front.lora_tensors(adapter, first)
        try:
            async with aclosing(front.triton.generate(model.inputs, {**tensors, **extra}, request_id,
                                                      stopper=front.catalog.stopper)) as responses:
                async for outputs in responses:
                    piece = "".join(strings(outputs.get("text_output")))
                    texts.append(piece)
                    outcome.prompt_tokens = first_int(outputs.get("num_input_tokens")) or outcome.prompt_tokens
                    count = first_int(outputs.get("num_output_tokens"))
                    if count is not None:
                        outcome.completion_tokens = count
                    if echoes:
                        continue
                    out = stop.feed(piece)
                    if out:
                        yield out
                    if stop.stopped:
                        break  # closing the responses stops the rest of the generation on the server
            break
        except APIError as exc:
            if adapter is None or attempt or UNKNOWN_TASK not in exc.message or adapter.weights is None:
                raise
    if echoes:
        whole = "".join(texts)
        texts = [_without_prompt(whole, generation.prompt, model)]
        out = stop.feed(texts[0])
        if out:
            yield out
    tail = stop.flush()
    if tail:
        yield tail
    if outcome.prompt_tokens is None:
        outcome.prompt_tokens = generation.prompt_tokens
    if outcome.completion_tokens is None:
        outcome.completion_tokens = model.count("".join(texts), special=False) if model.tokenizer else None
    if stop.stopped:
        outcome.finish_reason = "stop"
    elif outcome.completion_tokens is not None and outcome.completion_tokens >= generation.max_tokens:
        outcome.finish_reason = "length"


def _without_prompt(whole: str, prompt: str, model: TextModel) -> str:
    """An echoing profile's answer without its prompt (as the postprocessing decoded it, or as sent)."""
    shown = [prompt]
    if model.tokenizer is not None and not hasattr(model.tokenizer, "max_length"):
        from ...served import forge_text

        ids = forge_text.token_ids(prompt, model.tokenizer, model.add_special_tokens)
        shown.insert(0, forge_text.decode(model.tokenizer, ids, True))
    for text in shown:
        if whole.startswith(text):
            return whole[len(text):]
    return whole


def usage(outcome: Outcome) -> dict[str, int] | None:
    if outcome.prompt_tokens is None or outcome.completion_tokens is None:
        return None  # not measured: not reported as zero
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}


async def until_disconnected(request: Request, work):
    """Run ``work``; cancel it (and its generation on the server) when the client goes away."""
    task = asyncio.ensure_future(work)

    async def gone():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        raise APIError(499, "the client closed the connection")
    finally:
        watcher.cancel()


def sse(events: AsyncIterator[dict[str, Any]]):
    from sse_starlette.sse import EventSourceResponse

    async def lines():
        try:
            async for event in events:
                yield {"data": json.dumps(event, separators=(",", ":"))}
        except APIError as exc:  # after the headers went out: the error is the last event
            yield {"data": json.dumps(exc.body())}
        yield {"data": "[DONE]"}

    return EventSourceResponse(lines(), sep="\n", ping=15)


# -- the application ---------------------------------------------------------------------------------

class Draining:
    """ASGI middleware: counts the API requests in flight on ``front`` until their response is sent whole
    (a stream to its ``[DONE]``); once ``front.draining``, new ones get 503 with ``Retry-After``."""

    def __init__(self, app, front: Front):
        self.app = app
        self.front = front

    async def __call__(self, scope, receive, send):
        front = self.front
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if front.draining:
            error = APIError(503, "the server is shutting down: it finishes the requests in flight and takes no "
                                  "new ones", code="server_shutting_down", headers={"Retry-After": "5"})
            return await JSONResponse(error.body(), 503, headers=error.headers)(scope, receive, send)
        front.in_flight += 1  # on the event loop's thread only; forge serve's thread reads ``idle``
        front.idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            front.in_flight -= 1
            if not front.in_flight:
                front.idle.set()


def create_app(front: Front) -> FastAPI:
    """The FastAPI application of ``front``."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        front.triton = Triton(front.grpc_url)
        yield
        await front.triton.close()

    app = FastAPI(title="forge OpenAI API", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(Draining, front=front)
    catalog = front.catalog

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status if exc.status != 499 else 400, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        elif first.get("type") == "extra_forbidden":
            message = f"unrecognized request argument supplied: {where}"
        else:
            message = f"{where or 'body'}: {first.get('msg', 'invalid value')}"
        return JSONResponse(APIError(400, message, param=where or None, code="invalid_request").body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return JSONResponse(APIError(exc.status_code, message.get(exc.status_code, str(exc.detail))).body(),
                            exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}").body(), 500)

    async def authorized(request: Request) -> None:
        if front.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {front.api_key}":
            raise APIError(401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    guarded = [Depends(authorized)]

    @app.get("/health/live")
    async def live():
        if front.draining:
            return JSONResponse({"status": "draining"}, 200)
        ok, reason = await front.triton.ready([])
        return JSONResponse({"status": "live" if ok else reason}, 200 if ok else 503)

    @app.get("/health/ready")
    async def ready():
        if front.draining:
            return JSONResponse({"status": "draining: the server is shutting down"}, 503, headers={"Retry-After": "5"})
        ok, reason = await front.triton.ready(front.models_behind())
        return JSONResponse({"status": "ready" if ok else reason}, 200 if ok else 503)

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [model_card(catalog, i) for i in catalog.ids()]}

    @app.get("/v1/models/{model_id:path}", dependencies=guarded)
    async def model(model_id: str):
        front.resolve(model_id)
        return model_card(catalog, model_id)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(body: ChatRequest, request: Request):
        unsupported(body)
        adapter = front.resolve(body.model)
        model = front.generator()
        prompt, image = rq.chat_prompt(catalog, body)
        guide, tools = rq.chat_guide(body)
        prompt_tokens = model.count(prompt) if model.tokenizer is not None else None
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        generation = rq.Generation(prompt, rq.max_tokens(catalog, asked, prompt_tokens, None), prompt_tokens,
                                   rq.sampling(body), body.stops(), guide, image, tools)
        ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())
        if body.stream:
            return sse(_chat_chunks(front, body, generation, adapter, ident, created))
        return await until_disconnected(request, _chat_answer(front, body, generation, adapter, ident, created))

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request):
        unsupported(body)
        adapter = front.resolve(body.model)
        model = front.generator()
        prompts = [body.prompt] if isinstance(body.prompt, str) else list(body.prompt)
        generations = []
        for prompt in prompts:
            if not prompt:
                raise APIError(400, "prompt must not be empty", param="prompt")
            count = model.count(prompt) if model.tokenizer is not None else None
            generations.append(rq.Generation(prompt, rq.max_tokens(catalog, body.max_tokens, count, 16), count,
                                             rq.sampling(body), body.stops()))
        ident, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())
        if body.stream:
            return sse(_completion_chunks(front, body, generations, adapter, ident, created))
        return await until_disconnected(request, _completion_answer(front, body, generations, adapter, ident,
                                                                    created))

    @app.post("/v1/embeddings", dependencies=guarded)
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await until_disconnected(request, _embeddings(front, body))

    return app


# -- chat ----------------------------------------------------------------------------------------------

def _chat_message(text: str, tools: str | None) -> tuple[dict[str, Any], str | None]:
    calls = rq.tool_calls(text, tools)
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": calls, "refusal": None}, "tool_calls"
    return {"role": "assistant", "content": text, "refusal": None}, None


async def _chat_answer(front: Front, body: ChatRequest, generation: rq.Generation, adapter, ident: str,
                       created: int) -> dict[str, Any]:
    outcome = Outcome()
    pieces = [p async for p in generate(front, generation, adapter, stream=False, outcome=outcome,
                                        request_id=ident)]
    message, reason = _chat_message("".join(pieces), generation.tools)
    return {"id": ident, "object": "chat.completion", "created": created, "model": body.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": reason or outcome.finish_reason}],
            "usage": usage(outcome)}


async def _chat_chunks(front: Front, body: ChatRequest, generation: rq.Generation, adapter, ident: str,
                       created: int) -> AsyncIterator[dict[str, Any]]:
    with_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        event = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": body.model,
                 "system_fingerprint": None,
                 "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
        if with_usage:
            event["usage"] = None
        return event

    outcome = Outcome()
    yield chunk({"role": "assistant", "content": ""})
    held: list[str] = []  # an answer that may be a tool call is sent whole, once it is known
    async for piece in generate(front, generation, adapter, stream=True, outcome=outcome, request_id=ident):
        if generation.tools:
            held.append(piece)
        else:
            yield chunk({"content": piece})
    reason = outcome.finish_reason
    if generation.tools:
        message, called = _chat_message("".join(held), generation.tools)
        if called:
            reason = called
            yield chunk({"tool_calls": [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]})
        elif message["content"]:
            yield chunk({"content": message["content"]})
    yield chunk({}, reason)
    if with_usage:
        yield {"id": ident, "object": "chat.completion.chunk", "created": created, "model": body.model,
               "system_fingerprint": None, "choices": [], "usage": usage(outcome)}


# -- completions -------------------------------------------------------------------------------------

async def _completion_answer(front: Front, body: CompletionRequest, generations: list[rq.Generation], adapter,
                             ident: str, created: int) -> dict[str, Any]:
    async def one(index: int, generation: rq.Generation):
        outcome = Outcome()
        text = "".join([p async for p in generate(front, generation, adapter, stream=False, outcome=outcome,
                                                  request_id=f"{ident}-{index}")])
        return {"index": index, "text": (generation.prompt + text) if body.echo else text, "logprobs": None,
                "finish_reason": outcome.finish_reason}, outcome

    answers = await asyncio.gather(*(one(i, g) for i, g in enumerate(generations)))
    counted = [usage(o) for _, o in answers]
    total = None if any(u is None for u in counted) else {
        key: sum(u[key] for u in counted) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {"id": ident, "object": "text_completion", "created": created, "model": body.model,
            "system_fingerprint": None, "choices": [c for c, _ in answers], "usage": total}


async def _completion_chunks(front: Front, body: CompletionRequest, generations: list[rq.Generation], adapter,
                             ident: str, created: int) -> AsyncIterator[dict[str, Any]]:
    with_usage = bool(body.stream_options and body.stream_options.include_usage)
    queue: asyncio.Queue = asyncio.Queue()
    outcomes = [Outcome() for _ in generations]

    def chunk(index: int, text: str, reason: str | None = None) -> dict[str, Any]:
        event = {"id": ident, "object": "text_completion", "created": created, "model": body.model,
                 "system_fingerprint": None,
                 "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason}]}
        if with_usage:
            event["usage"] = None
        return event

    async def run(index: int, generation: rq.Generation):
        try:
            if body.echo:
                await queue.put(chunk(index, generation.prompt))
            async for piece in generate(front, generation, adapter, stream=True, outcome=outcomes[index],
                                        request_id=f"{ident}-{index}"):
                await queue.put(chunk(index, piece))
            await queue.put(chunk(index, "", outcomes[index].finish_reason))
        except APIError as exc:
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(run(i, g)) for i, g in enumerate(generations)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, APIError):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
    if with_usage:
        counted = [usage(o) for o in outcomes]
        total = None if any(u is None for u in counted) else {
            key: sum(u[key] for u in counted) for key in ("prompt_tokens", "completion_tokens", "total_tokens")}
        yield {"id": ident, "object": "text_completion", "created": created, "model": body.model,
               "system_fingerprint": None, "choices": [], "usage": total}


# -- embeddings --------------------------------------------------------------------------------------

async def _embeddings(front: Front, body: EmbeddingRequest) -> dict[str, Any]:
    catalog = front.catalog
    front.resolve(body.model)
    model = catalog.embedder
    if model is None:
        raise APIError(400, f"model {catalog.model_id!r} makes no embeddings (it generates text); use "
                            "/v1/chat/completions", param="model", code="wrong_endpoint")
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts:
        raise APIError(400, "input must not be an empty list", param="input")
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, "input as token ids is not supported: send text", param="input",
                       code="unsupported_parameter")
    if body.dimensions is not None and body.dimensions != catalog.embedding_dim:
        raise APIError(400, f"dimensions: this model makes {catalog.embedding_dim}-dimensional embeddings and "
                            "cannot shorten them", param="dimensions", code="unsupported_parameter")

    async def one(text: str) -> np.ndarray:
        tensors = {"text_input": model.inputs.array("text_input", text)}
        outputs = await front.triton.infer(model.inputs, tensors, "", ["embedding"])
        return np.asarray(outputs["embedding"], dtype=np.float32).reshape(-1)

    vectors = await asyncio.gather(*(one(t) for t in texts))
    data = []
    for index, vector in enumerate(vectors):
        value: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode() \
            if body.encoding_format == "base64" else vector.tolist()
        data.append({"object": "embedding", "index": index, "embedding": value})
    tokens = sum(model.count(t) for t in texts) if model.tokenizer is not None else None
    return {"object": "list", "data": data, "model": body.model,
            "usage": None if tokens is None else {"prompt_tokens": tokens, "total_tokens": tokens}}
