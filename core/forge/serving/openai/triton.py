"""The OpenAI front's way to the tritonserver it fronts: asyncio gRPC, streamed where the model is decoupled.

Cancelling the task that iterates a generation (a client that went away) cancels the gRPC call, and
Triton passes the cancellation to the model, which stops generating.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Mapping

import numpy as np

from ..client import ModelInputs, _grpc_message
from .protocol import APIError

_STATUS = {"StatusCode.INVALID_ARGUMENT": 400, "StatusCode.UNAVAILABLE": 503, "StatusCode.NOT_FOUND": 503,
           "StatusCode.CANCELLED": 499, "StatusCode.DEADLINE_EXCEEDED": 504, "StatusCode.RESOURCE_EXHAUSTED": 429}


def api_error(exc: Exception, model: str) -> APIError:
    """A Triton error as the OpenAI API answers it: its own message, the status its gRPC code maps to."""
    status_of = getattr(exc, "status", None)
    code = status_of() if callable(status_of) else None
    message = _grpc_message(exc) or f"model {model!r} failed without a message"
    status = _STATUS.get(str(code), 500)
    if "failed to connect" in message.lower() or "connection refused" in message.lower():
        status, message = 503, f"the tritonserver behind this API is not reachable ({message})"
    elif "not ready" in message.lower() or "unavailable" in message.lower():
        status = 503
    if status == 499:
        status = 503
    return APIError(status, message, code="triton_error" if status != 503 else "model_unavailable",
                    headers={"Retry-After": "5"} if status == 503 else None)


class Triton:
    """One asyncio gRPC client, shared by every request (create it inside the event loop)."""

    def __init__(self, url: str):
        import tritonclient.grpc.aio as aio

        self._aio = aio
        self.client = aio.InferenceServerClient(url)

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
            return False, f"tritonserver does not answer: {_grpc_message(exc)}"
        return True, "ready"

    async def infer(self, model: ModelInputs, tensors: Mapping[str, np.ndarray], request_id: str,
                    outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """One request, one response (non-decoupled models)."""
        requested = None
        if outputs:
            requested = [self._aio.InferRequestedOutput(o) for o in outputs if o in model.outputs]
        try:
            result = await self.client.infer(model.name, self._inputs(tensors), request_id=request_id,
                                             outputs=requested)
        except self._aio.InferenceServerException as exc:
            raise api_error(exc, model.name) from None
        return {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}

    async def generate(self, model: ModelInputs, tensors: Mapping[str, np.ndarray], request_id: str,
                       outputs: list[str] | None = None) -> AsyncIterator[dict[str, np.ndarray]]:
        """The responses of one request as they arrive; a non-decoupled model answers once."""
        if not model.decoupled:
            yield await self.infer(model, tensors, request_id, outputs)
            return
        requested = None
        if outputs:
            requested = [self._aio.InferRequestedOutput(o) for o in outputs if o in model.outputs]
        inputs = self._inputs(tensors)

        async def one_request():
            yield {"model_name": model.name, "inputs": inputs, "request_id": request_id, "outputs": requested,
                   "enable_empty_final_response": True}

        responses = self.client.stream_infer(one_request())
        try:
            async for result, error in responses:
                if error is not None:
                    raise api_error(error, model.name)
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param \
                    if "triton_final_response" in response.parameters else True
                tensors_out = {o.name: result.as_numpy(o.name) for o in response.outputs}
                if tensors_out:
                    yield tensors_out
                if final:
                    return
        finally:
            responses.cancel()


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
