"""The OpenAI front's way to the tritonserver it fronts: asyncio gRPC, streamed where the model is decoupled.

Cancelling the task that iterates a generation (a client that went away) cancels the gRPC call, and
Triton passes the cancellation to the model, which stops generating. When a model's process dies,
``forge serve`` calls ``recovering``: the front's requests in flight on that model fail at once (503), and
new ones wait (up to RECOVERY_WAIT_S) until ``recovered`` says the model is back.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Mapping

import numpy as np

from ..clients.inference import STREAM_CLOSE_S, ModelInputs, grpc_message
from ..in_triton.forge_glue import FRONT_REQUEST_PREFIX
from .protocol import APIError

#: how long a request waits for a model whose process died to be back (loaded again, or tritonserver restarted)
RECOVERY_WAIT_S = 120.0

_STATUS = {"StatusCode.INVALID_ARGUMENT": 400, "StatusCode.UNAVAILABLE": 503, "StatusCode.NOT_FOUND": 503,
           "StatusCode.CANCELLED": 499, "StatusCode.DEADLINE_EXCEEDED": 504, "StatusCode.RESOURCE_EXHAUSTED": 429}


def api_error(exc: Exception, model: str) -> APIError:
    """A Triton error as the OpenAI API answers it: its own message, the status its gRPC code maps to."""
    status_of = getattr(exc, "status", None) or getattr(exc, "code", None)  # Triton's or grpc's own error
    code = status_of() if callable(status_of) else None
    details = getattr(exc, "details", None)
    message = (details() if callable(details) and not hasattr(exc, "message") else grpc_message(exc)) \
        or f"model {model!r} failed without a message"
    status = _STATUS.get(str(code), 500)
    if "failed to connect" in message.lower() or "connection refused" in message.lower():
        status, message = 503, f"the tritonserver behind this API is not reachable ({message})"
    elif any(word in message.lower() for word in ("not ready", "unavailable", "is not healthy")):
        status = 503  # "Stub process ... is not healthy": the model's process died and is being brought back
    if status == 499:
        status = 503
    return unavailable(message) if status == 503 else APIError(status, message, code="triton_error")


def unavailable(message: str) -> APIError:
    """A 503 for a model that cannot answer now (tritonserver unreachable, the model coming back): retry soon."""
    return APIError(503, message, code="model_unavailable", headers={"Retry-After": "5"})


#: gRPC's reconnect back-off grows to minutes; bounded, the front sees a restarted tritonserver within a second
RECONNECT_BACKOFF_MS = (100, 500)


def channel_args() -> list[tuple[str, int]]:
    """tritonclient's own channel options (message sizes, keepalive) plus a bounded reconnect back-off."""
    from tritonclient.grpc import KeepAliveOptions
    from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE as most

    keepalive = KeepAliveOptions()
    initial, longest = RECONNECT_BACKOFF_MS
    return [("grpc.max_send_message_length", most),
            ("grpc.max_receive_message_length", most),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ("grpc.initial_reconnect_backoff_ms", initial), ("grpc.min_reconnect_backoff_ms", initial),
            ("grpc.max_reconnect_backoff_ms", longest)]


class Triton:
    """One asyncio gRPC client, shared by every request (create it inside the event loop)."""

    def __init__(self, url: str):
        import tritonclient.grpc.aio as aio

        import grpc

        self._aio = aio
        self._stopping: set = set()
        self._grpc_error = grpc.RpcError
        self.client = aio.InferenceServerClient(url, channel_args=channel_args())
        self._calls: dict[str, set[_Call]] = {}  # model → the calls in flight on it (an ensemble's: on each step)
        self.paused: dict[str, asyncio.Event] = {}  # model whose process died → set once it is back

    # -- a model process that died (called on the event loop) -------------------------------------
    def recovering(self, models: list[str], reason: str) -> int:
        """Fail the calls in flight on ``models`` with ``reason`` (503) and hold new ones until ``recovered``;
        how many were failed."""
        for model in models:
            self.paused.setdefault(model, asyncio.Event())
        hit = {call for model in models for call in self._calls.get(model, ())}
        for call in hit:
            call.fail(reason)
        return len(hit)

    def recovered(self, models: list[str]) -> None:
        for model in models:
            event = self.paused.pop(model, None)
            if event is not None:
                event.set()

    async def _until_back(self, model: ModelInputs) -> None:
        for name in (model.name, *model.steps):
            event = self.paused.get(name)
            if event is None:
                continue
            try:
                await asyncio.wait_for(event.wait(), RECOVERY_WAIT_S)
            except asyncio.TimeoutError:
                raise unavailable(f"model {name!r} is not back {RECOVERY_WAIT_S:g} s after its process died") from None

    def _watch(self, model: ModelInputs, cancel) -> "_Call":
        call = _Call(cancel, [model.name, *model.steps], self._calls)
        for name in call.names:
            self._calls.setdefault(name, set()).add(call)
        return call

    async def close(self) -> None:
        await self.client.close()

    def _inputs(self, tensors: Mapping[str, np.ndarray]) -> list:
        from tritonclient.utils import np_to_triton_dtype

        result = []
        for name, array in tensors.items():
            dtype = "BYTES" if array.dtype == np.object_ else np_to_triton_dtype(array.dtype)
            tensor = self._aio.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            result.append(tensor)
        return result

    async def ready(self, models: list[str]) -> tuple[bool, str]:
        """Whether the server and each of ``models`` are ready (and which one is not)."""
        try:
            if not await self.client.is_server_live():
                return False, "tritonserver is not live"
            for model in models:
                if not await self.client.is_model_ready(model):
                    return False, f"model {model!r} is not ready"
        except Exception as exc:  # noqa: BLE001 - any failure to ask is "not ready", with its reason
            return False, f"tritonserver does not answer: {grpc_message(exc)}"
        return True, "ready"

    async def infer(self, model: ModelInputs, tensors: Mapping[str, np.ndarray], request_id: str,
                    outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """One request, one response (non-decoupled models)."""
        requested = None
        if outputs:
            requested = [self._aio.InferRequestedOutput(o) for o in outputs if o in model.outputs]
        await self._until_back(model)
        pending = asyncio.ensure_future(self.client.infer(model.name, self._inputs(tensors),
                                                          request_id=FRONT_REQUEST_PREFIX + request_id,
                                                          outputs=requested))
        call = self._watch(model, pending.cancel)
        try:
            result = await pending
        except (self._aio.InferenceServerException, self._grpc_error) as exc:
            raise api_error(exc, model.name) from None
        except asyncio.CancelledError:
            call.raise_failure()
            raise
        finally:
            call.done()
        return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}

    async def generate(self, model: ModelInputs, tensors: Mapping[str, np.ndarray], request_id: str,
                       outputs: list[str] | None = None,
                       stopper: ModelInputs | None = None) -> AsyncIterator[dict[str, np.ndarray]]:
        """The responses of one request as they arrive; a non-decoupled model answers once.

        A request left before its end (the client went away, a stop string was found) is stopped on the
        server by TensorRT-LLM's ``stop`` request to ``stopper`` under the same request id: Triton 2.51
        does not pass the cancellation of an ensemble request on to the model generating inside it.
        """
        finished = False
        try:
            async for response in self._generate(model, tensors, request_id, outputs):
                yield response
            finished = True
        except APIError:
            finished = True  # the server ended it
            raise
        finally:
            if not finished and stopper is not None and request_id:
                task = asyncio.ensure_future(self._stop(stopper, request_id))
                self._stopping.add(task)
                task.add_done_callback(self._stopping.discard)

    async def _stop(self, stopper: ModelInputs, request_id: str) -> None:
        tensors = {"stop": stopper.array("stop", True)}
        for name in ("input_ids", "input_lengths", "request_output_len"):
            if name in stopper.inputs:
                tensors[name] = stopper.array(name, 1)
        try:
            async for _ in self._generate(stopper, tensors, request_id, None):
                pass
        except Exception:  # noqa: BLE001 - the request may have ended meanwhile; nothing is left to stop
            pass

    async def _generate(self, model: ModelInputs, tensors: Mapping[str, np.ndarray], request_id: str,
                        outputs: list[str] | None) -> AsyncIterator[dict[str, np.ndarray]]:
        if not model.decoupled:
            yield await self.infer(model, tensors, request_id, outputs)
            return
        requested = None
        if outputs:
            requested = [self._aio.InferRequestedOutput(o) for o in outputs if o in model.outputs]
        inputs = self._inputs(tensors)
        await self._until_back(model)

        async def one_request():
            yield {"model_name": model.name, "inputs": inputs, "request_id": FRONT_REQUEST_PREFIX + request_id,
                   "outputs": requested, "enable_empty_final_response": True}

        responses = self.client.stream_infer(one_request())
        call = self._watch(model, responses.cancel)
        ended = False  # the final response came: the server closes the stream itself
        try:
            async for result, error in _mapped(responses, model.name, self._grpc_error, call):
                if error is not None:
                    raise api_error(error, model.name)
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param \
                    if "triton_final_response" in response.parameters else True
                tensors_out = {o.name: result.as_numpy(o.name) for o in response.outputs}
                if tensors_out:
                    yield tensors_out
                if final:
                    ended = True
                    break
            else:
                call.raise_failure()  # a cancelled stream may also just end
        finally:
            call.done()
            if not ended:
                responses.cancel()
        # The request iterator has ended, so tritonserver closes the stream once it released the request.
        # Cancelling a stream right after its final response can leave tritonserver 2.51 holding the
        # request (and the ensemble it ran: a later stop waits out its exit timeout for that model).
        try:
            await asyncio.wait_for(_closed(responses), STREAM_CLOSE_S)
        except asyncio.CancelledError:  # the request's task is being cancelled: the stream goes with it
            responses.cancel()
            raise
        except Exception:  # noqa: BLE001 - a timeout, a lost connection: closing is best effort
            responses.cancel()


async def _closed(responses) -> None:
    """Read a stream whose final response came to its end (the server closing it)."""
    async for _ in responses:
        pass


async def _mapped(responses, model: str, grpc_error, call: "_Call"):
    """The stream's (result, error) pairs; a failed call (no server, connection lost, its model's process died)
    as an APIError."""
    try:
        async for pair in responses:
            yield pair
    except grpc_error as exc:
        call.raise_failure()
        raise api_error(exc, model) from None
    except asyncio.CancelledError:
        call.raise_failure()
        raise


class _Call:
    """A call in flight on some models, which ``Triton.recovering`` fails (its reason, then ``cancel``)."""

    __slots__ = ("cancel", "names", "reason", "_registry")

    def __init__(self, cancel, names: list[str], registry: dict):
        self.cancel, self.names, self.reason, self._registry = cancel, names, None, registry

    def fail(self, reason: str) -> None:
        self.reason = reason
        self.cancel()

    def raise_failure(self) -> None:
        if self.reason is not None:
            raise unavailable(self.reason)

    def done(self) -> None:
        for name in self.names:
            calls = self._registry.get(name)
            if calls is not None:
                calls.discard(self)
                if not calls:
                    del self._registry[name]


def strings(value: Any) -> list[str]:
    """A BYTES output as Python strings (one per batch row)."""
    if value is None:
        return []
    flat = np.asarray(value, dtype=object).reshape(-1).tolist()
    return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in flat]


def first_int(value: Any) -> int | None:
    if value is None:
        return None
    flat = np.asarray(value).reshape(-1)
    return int(flat[0]) if flat.size else None
