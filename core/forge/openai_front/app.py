"""The OpenAI API routes (FastAPI): models, chat completions, completions, embeddings, health, and vLLM's
utility routes (``/tokenize``, ``/detokenize``, ``/tokenizer_info``, ``/version``, ``/health``, ``/metrics``).

Every route answers OpenAI's error shape; generation goes to the served ensemble through
:class:`~forge.openai_front.upstream.Triton`, so the same front serves every target. The answers themselves
are built in ``chat``, ``completions``, ``embeddings`` and ``tokenizer_api``. As vLLM's, the API key guards
the ``/v1`` routes; ``/tokenizer_info`` (which vLLM serves only when asked to) is guarded too.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any, AsyncIterator

from fastapi import Body, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from . import chat, completions, embeddings, tokenizer_api
from .generation import probe
from .catalog import model_card
from .front import Front
from .metrics import CONTENT_TYPE, Counted
from .protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeChat,
                       TokenizePrompt, unsupported)
from .schema import (ChatCompletion, Completion, Detokenized, EmbeddingList, ErrorBody, ModelCard, ModelList,
                     Tokenized, TokenizerInfo, Version)
from .upstream import Triton

#: the largest request body read (a long prompt, an inline image); larger ones get 400 before they are read
MAX_BODY_BYTES = 32 * 2**20
#: how long /health_generate waits for its one token
HEALTH_GENERATE_TIMEOUT_S = 10.0


# -- how an answer leaves -----------------------------------------------------------------------------

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


def sse(events: AsyncIterator[BaseModel]):
    """``events`` as Server-Sent Events, ending with ``[DONE]`` (an error after the first event is the last)."""
    from sse_starlette.sse import EventSourceResponse

    async def lines():
        try:
            async for event in events:
                yield {"data": event.model_dump_json()}
        except APIError as exc:  # after the headers went out: the error is the last event
            yield {"data": json.dumps(exc.body())}
        yield {"data": "[DONE]"}

    return EventSourceResponse(lines(), sep="\n", ping=15)


def answered(answer: BaseModel) -> JSONResponse:
    """``answer`` as its JSON (the route's ``response_model`` documents it; it is not validated twice)."""
    return JSONResponse(answer.model_dump(mode="json"))


class ErrorResponse(JSONResponse):
    """An error in OpenAI's shape, as ASCII JSON: a message that quotes a client's invalid Unicode (a lone
    surrogate) still goes out."""

    def __init__(self, error: APIError):
        super().__init__(error.body(), error.status if error.status != 499 else 400, headers=error.headers)

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


# -- the application ---------------------------------------------------------------------------------

class BodyLimit:
    """ASGI middleware: a request body over ``MAX_BODY_BYTES`` gets 400 (by its Content-Length before it is
    read; a chunked one once it has grown past the limit)."""

    def __init__(self, app):
        self.app = app

    @staticmethod
    def error() -> APIError:
        return APIError(400, f"the request body is larger than this server reads ({MAX_BODY_BYTES // 2**20} MiB)",
                        code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                return await ErrorResponse(self.error())(scope, receive, send)
            return await self.app(scope, receive, send)
        read = 0

        async def counted():
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if read > MAX_BODY_BYTES:
                raise StarletteHTTPException(400, self.error().message)
            return message

        return await self.app(scope, counted, send)


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
            return await ErrorResponse(error)(scope, receive, send)
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
        front.loop = asyncio.get_running_loop()
        yield
        await front.triton.close()

    # /openapi.json describes every route with its typed answers; no browsable docs (they load scripts from a CDN)
    app = FastAPI(title="forge OpenAI API", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", responses={400: {"model": ErrorBody}, 401: {"model": ErrorBody},
                                                          404: {"model": ErrorBody}, 503: {"model": ErrorBody}})
    app.add_middleware(Draining, front=front)
    app.add_middleware(BodyLimit)
    app.add_middleware(Counted, metrics=front.metrics)  # outermost: it counts what the others answer too
    catalog = front.catalog

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return ErrorResponse(exc)

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
        return ErrorResponse(APIError(400, message, param=where or None, code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        cause = {UnicodeDecodeError: "it is not UTF-8", RecursionError: "it is nested too deeply"}.get(
            type(exc.__cause__))
        if cause:  # FastAPI's "There was an error parsing the body"
            message[400] = f"the request body is not valid JSON: {cause}"
        return ErrorResponse(APIError(exc.status_code, message.get(exc.status_code, str(exc.detail))))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return ErrorResponse(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

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
        back = [m for m in front.models_behind() if m in front.triton.paused]
        if back:
            return JSONResponse({"status": f"model {back[0]!r} is coming back: its process died"}, 503,
                                headers={"Retry-After": "2"})
        ok, reason = await front.triton.ready(front.models_behind())
        return JSONResponse({"status": "ready" if ok else reason}, 200 if ok else 503)

    @app.get("/health", response_class=Response, description="vLLM's health check: an empty 200 while tritonserver "
                                                             "answers (as /health/live), else 503")
    async def health():
        ok = front.draining or (await front.triton.ready([]))[0]
        return Response(status_code=200 if ok else 503)

    @app.get("/health_generate", description=f"200 when the served model generates one token (an embedding model: "
                                             f"embeds one text) within {HEALTH_GENERATE_TIMEOUT_S:g} s, else 503")
    async def health_generate():
        if front.draining:
            return JSONResponse({"status": "draining: the server is shutting down"}, 503, headers={"Retry-After": "5"})
        ok, reason = await probe(front, HEALTH_GENERATE_TIMEOUT_S)
        return JSONResponse({"status": reason}, 200 if ok else 503)

    @app.get("/metrics", response_class=Response, description="Prometheus text exposition: vLLM's metric names "
                                                               "for what the front counts and for the served models' "
                                                               "requests waiting and running (read from tritonserver's "
                                                               "metrics), forge_openai_requests_total")
    async def metrics():
        return Response(await front.exposition(), media_type=CONTENT_TYPE)

    @app.get("/version", response_model=Version)
    async def version():
        return answered(Version(version=__version__))

    @app.post("/tokenize", response_model=Tokenized,
              description="body: {model?, prompt, add_special_tokens?} or {model?, messages, add_generation_prompt?, "
                          "continue_final_message?, chat_template_kwargs?, tools?}; return_token_strs adds token_strs")
    async def tokenize(body: dict[str, Any] = Body(...)):
        kind = TokenizeChat if "messages" in body else TokenizePrompt
        try:
            parsed = kind.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        return answered(await tokenizer_api.tokenize(front, parsed))

    @app.post("/detokenize", response_model=Detokenized)
    async def detokenize(body: DetokenizeRequest):
        return answered(await tokenizer_api.detokenize(front, body))

    @app.get("/tokenizer_info", dependencies=guarded, response_model=TokenizerInfo)
    async def tokenizer_info():
        return answered(tokenizer_api.tokenizer_info(front))

    @app.get("/v1/models", dependencies=guarded, response_model=ModelList)
    async def models():
        return answered(ModelList(data=[model_card(catalog, i) for i in catalog.ids()]))

    @app.get("/v1/models/{model_id:path}", dependencies=guarded, response_model=ModelCard)
    async def model(model_id: str):
        front.resolve(model_id)
        return answered(model_card(catalog, model_id))

    async def generated(route, prefix: str, body, request: Request):
        """A chat or completions request (``route``: the module with its ``prepare``, ``answer`` and ``chunks``):
        the whole answer, or its events as they come."""
        unsupported(body)
        adapter = front.resolve(body.model)
        prepared = await route.prepare(front, body)
        ident, created = f"{prefix}-{secrets.token_hex(12)}", int(time.time())
        if body.stream:
            return sse(route.chunks(front, body, prepared, adapter, ident, created))
        return answered(await until_disconnected(request, route.answer(front, body, prepared, adapter, ident,
                                                                       created)))

    @app.post("/v1/chat/completions", dependencies=guarded, response_model=ChatCompletion,
              description="the whole answer, or with stream: true Server-Sent Events of chat.completion.chunk")
    async def chat_completions(body: ChatRequest, request: Request):
        return await generated(chat, "chatcmpl", body, request)

    @app.post("/v1/completions", dependencies=guarded, response_model=Completion,
              description="the whole answer, or with stream: true Server-Sent Events of text_completion")
    async def text_completions(body: CompletionRequest, request: Request):
        return await generated(completions, "cmpl", body, request)

    @app.post("/v1/embeddings", dependencies=guarded, response_model=EmbeddingList)
    async def embed(body: EmbeddingRequest, request: Request):
        return answered(await until_disconnected(request, embeddings.answer(front, body)))

    return app
