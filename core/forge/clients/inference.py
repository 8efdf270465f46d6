"""Clients of a served decoder: Triton's HTTP generate endpoint and gRPC (streaming) inference.

Inputs are typed from the served model's own config, so one client talks to repositories of every
backend profile (``max_tokens`` is UINT32 for v0.5.0 and INT32 later; ``text_input`` is ``[-1]`` or
``[1]``) and to hand-written text models that take ``text_input`` and ``max_tokens``.

``GrpcSession`` and ``HttpSession`` answer the same questions (is the server live, which models, their
configs) and send one request at a time with ``send``, yielding its responses as they arrive, so a
load generator is written once for both protocols.
"""

from __future__ import annotations

import base64
import http.client
import json
import queue
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np

from ..errors import ForgeError, UsageError

STREAM_CLOSE_S = 5.0  # the longest closing a session waits for the server to end its stream
_NUMPY = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
          "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "STRING": np.object_,
          "BYTES": np.object_}

# forge infer's sampling flags → the ensemble / BLS input names of tensorrtllm_backend, oldest first
# (1.0 renamed random_seed to seed and min_length to min_tokens), then the LLM-API model's (sampling_param_*)
SAMPLING_INPUTS = {"temperature": ("temperature", "sampling_param_temperature"),
                   "top_k": ("top_k", "sampling_param_top_k"), "top_p": ("top_p", "sampling_param_top_p"),
                   "seed": ("random_seed", "seed", "sampling_param_seed"),
                   "repetition_penalty": ("repetition_penalty",),
                   "presence_penalty": ("presence_penalty", "sampling_param_presence_penalty"),
                   "frequency_penalty": ("frequency_penalty", "sampling_param_frequency_penalty"),
                   "min_length": ("min_length", "min_tokens")}
# The generate inputs whose name differs on the LLM-API tensorrt_llm model (text in, text out)
MAX_TOKENS = ("max_tokens", "sampling_param_max_tokens")
STREAM = ("stream", "streaming")
EXCLUDE_INPUT = ("exclude_input_in_output", "sampling_param_exclude_input_from_output")


def first_input(inputs: "ModelInputs", names: tuple[str, ...]) -> str | None:
    """The first of ``names`` the model takes (one meaning, named per backend release)."""
    return next((n for n in names if n in inputs.inputs), None)


def is_text_generator(inputs: "ModelInputs") -> bool:
    """Whether the model takes a prompt as text and a token budget (an ensemble, BLS or LLM-API model)."""
    return "text_input" in inputs.inputs and first_input(inputs, MAX_TOKENS) is not None


def http_base(url: str) -> str:
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


def grpc_target(url: str) -> str:
    for prefix in ("grpc://", "http://", "https://"):
        url = url.removeprefix(prefix)
    return url.rstrip("/")


@dataclass
class ModelInputs:
    """The inputs of a served model: name → (Triton dtype, dims without the batch dim), and batching."""

    name: str
    inputs: dict[str, tuple[str, list[int]]]
    batching: bool
    outputs: list[str] = field(default_factory=list)
    decoupled: bool = False
    parameters: dict[str, str] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)  # an ensemble's models, in order

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelInputs":
        """From a model config in Triton's JSON form (the HTTP config route, or MessageToDict of the protobuf)."""
        inputs = {i["name"]: (i.get("data_type", "TYPE_INVALID").removeprefix("TYPE_"),
                              [int(d) for d in i.get("dims", [])])
                  for i in config.get("input", [])}
        outputs = [o["name"] for o in config.get("output", [])]
        decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
        parameters = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        steps = [s.get("model_name", "") for s in config.get("ensemble_scheduling", {}).get("step", [])]
        return cls(config.get("name", ""), inputs, int(config.get("max_batch_size", 0)) > 0, outputs, decoupled,
                   parameters, steps)

    def array(self, name: str, value: Any) -> np.ndarray:
        """``value`` as this input's dtype and shape, for a batch of one."""
        dtype, dims = self.inputs[name]
        np_type = _NUMPY.get(dtype)
        if np_type is None:
            raise UsageError(f"input {name!r} of model {self.name!r} has type {dtype}, which forge infer cannot send")
        if np_type is np.object_:
            values = value if isinstance(value, (list, tuple)) else [value]
            array = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)
        else:
            array = np.array(value if isinstance(value, (list, tuple, np.ndarray)) else [value], dtype=np_type)
        array = array.reshape(-1)
        if len(dims) > 1:  # e.g. [2, -1] word lists
            array = array.reshape([d if d > 0 else -1 for d in dims])
        if self.batching:
            array = array[None, ...]
        return array


def model_config(http_url: str, model: str, timeout: float = 10.0) -> dict[str, Any]:
    """The served model's config (Triton's JSON form)."""
    url = f"{http_base(http_url)}/v2/models/{model}/config"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ForgeError(f"model {model!r} is not served at {http_url}: {_error_text(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ForgeError(f"cannot reach a Triton server at {http_url}: {getattr(exc, 'reason', exc)}",
                         hint="start one with 'forge serve REPO' or pass --url") from None


def text_model(http_url: str, timeout: float = 10.0) -> str:
    """The model a text request goes to when none is named: ``ensemble``, else the one text generator served."""
    url = f"{http_base(http_url)}/v2/repository/index"
    try:
        request = urllib.request.Request(url, data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            names = sorted({m["name"] for m in json.loads(response.read()) if m.get("state", "READY") == "READY"})
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ForgeError(f"cannot reach a Triton server at {http_url}: {getattr(exc, 'reason', exc)}",
                         hint="start one with 'forge serve REPO' or pass --url") from None
    if "ensemble" in names:
        return "ensemble"
    texts = [n for n in names if is_text_generator(ModelInputs.from_config(model_config(http_url, n, timeout)))]
    if len(texts) == 1:
        return texts[0]
    raise UsageError(f"{http_url} serves {'no text model' if not texts else 'several text models: ' + ', '.join(texts)}",
                     hint="name one with --model")


def _error_text(exc: urllib.error.HTTPError) -> str:
    body = exc.read().decode(errors="replace")
    try:
        return json.loads(body).get("error", body)
    except ValueError:
        return body or str(exc)


def generate_payload(inputs: ModelInputs, prompt: str, max_tokens: int, *, stop_words: list[str] = (),
                     bad_words: list[str] = (), stream: bool = False, image: bytes | None = None,
                     **sampling: Any) -> dict[str, Any]:
    """The inputs of a generate request: only inputs the model has (unknown sampling flags refused).

    ``image`` (encoded bytes) goes to a multimodal ensemble's ``image`` input; JSON bodies carry it
    base64-encoded (:func:`json_body`).
    """
    if not is_text_generator(inputs):
        missing = next(k for k in ("text_input", "max_tokens") if k not in inputs.inputs)
        raise UsageError(f"model {inputs.name!r} is not a text-generation model (no input {missing!r}); "
                         "point --model at the ensemble or the BLS model")
    payload: dict[str, Any] = {"text_input": prompt, first_input(inputs, MAX_TOKENS): max_tokens}
    if image is not None:
        if "image" not in inputs.inputs:
            raise UsageError(f"model {inputs.name!r} takes no image (no input 'image')",
                             hint="serve a multimodal repository (forge build --family llava) and ask its ensemble")
        payload["image"] = image
    if "bad_words" in inputs.inputs:
        payload["bad_words"] = ",".join(bad_words) if bad_words else ""
    if "stop_words" in inputs.inputs:
        payload["stop_words"] = ",".join(stop_words) if stop_words else ""
    elif stop_words and "sampling_param_stop" in inputs.inputs:
        payload["sampling_param_stop"] = list(stop_words)
    elif stop_words:
        raise UsageError(f"model {inputs.name!r} takes no stop words")
    if bad_words and "bad_words" not in inputs.inputs:
        raise UsageError(f"model {inputs.name!r} takes no bad words")
    stream_input = first_input(inputs, STREAM)
    if stream and stream_input is not None:
        payload[stream_input] = True
    for flag, value in sampling.items():
        if value is None:
            continue
        names = EXCLUDE_INPUT if flag == "exclude_input" else SAMPLING_INPUTS.get(flag, (flag,))
        name = next((n for n in names if n in inputs.inputs), None)
        if name is None:
            raise UsageError(f"model {inputs.name!r} has no input {names[0]!r} for --{flag.replace('_', '-')}",
                             hint="its backend release lacks it" if flag == "exclude_input" else None)
        payload[name] = value
    return payload


def json_body(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A generate request's inputs as JSON values: bytes (an image) become base64 strings."""
    return {k: base64.b64encode(v).decode() if isinstance(v, bytes) else v for k, v in payload.items()}


def generate(http_url: str, model: str, payload: Mapping[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """POST /v2/models/<model>/generate; the response JSON (``text_output`` …)."""
    request = urllib.request.Request(f"{http_base(http_url)}/v2/models/{model}/generate",
                                     data=json.dumps(json_body(payload)).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ForgeError(f"the server refused the request: {_error_text(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ForgeError(f"cannot reach a Triton server at {http_url}: {getattr(exc, 'reason', exc)}") from None


def text_of(value: Any) -> str:
    """A ``text_output`` value (str, bytes, or a list of them) as one string."""
    if isinstance(value, (list, tuple)):
        return "".join(text_of(v) for v in value)
    if isinstance(value, np.ndarray):
        return "".join(text_of(v) for v in value.reshape(-1).tolist())
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


@dataclass
class StreamEvent:
    """One response of a streamed request."""

    outputs: dict[str, np.ndarray]
    final: bool
    seconds: float  # since the request was sent
    at: float = 0.0  # when it arrived (time.perf_counter)


class GrpcSession:
    """A gRPC client that sends one request at a time, streamed or not, and can cancel it."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.url = grpc_target(url)
        self.client = grpcclient.InferenceServerClient(self.url)
        self._events: queue.Queue = queue.Queue()
        self._streaming = False
        self._unanswered = False  # a streamed request whose final response has not come

    def close(self) -> None:
        if self._streaming:
            # A stream whose requests all ended is closed, not cancelled: cancelling one right after its final
            # response can leave tritonserver 2.51 holding the request (its stop then times out). Closing waits
            # for the server to end the stream: at most STREAM_CLOSE_S, then closing the channel cancels it.
            closer = threading.Thread(target=self._stop_stream, name="forge-stream-close", daemon=True)
            closer.start()
            closer.join(STREAM_CLOSE_S)
            self._streaming = False
        self.client.close()

    def _stop_stream(self) -> None:
        try:
            self.client.stop_stream(cancel_requests=self._unanswered)
        except Exception:  # noqa: BLE001 - the stream is gone either way
            pass

    def __enter__(self) -> "GrpcSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def config(self, model: str) -> ModelInputs:
        from google.protobuf import json_format

        try:
            response = self.client.get_model_config(model)
        except Exception as exc:
            message = _grpc_message(exc)
            if "failed to connect" in message.lower() or "unavailable" in message.lower():
                raise ForgeError(f"cannot reach a Triton server's gRPC endpoint at {self.url}",
                                 hint="start one with 'forge serve REPO', or pass its gRPC host:port") from None
            raise ForgeError(f"model {model!r} is not available at {self.url}: {message}") from None
        config = json_format.MessageToDict(response.config, preserving_proto_field_name=True)
        return ModelInputs.from_config(config)

    def _inputs(self, tensors: Mapping[str, np.ndarray]) -> list:
        result = []
        for name, array in tensors.items():
            triton_type = "BYTES" if array.dtype == np.object_ else self._grpc_dtype(array)
            tensor = self._grpc.InferInput(name, list(array.shape), triton_type)
            tensor.set_data_from_numpy(array)
            result.append(tensor)
        return result

    @staticmethod
    def _grpc_dtype(array: np.ndarray) -> str:
        from tritonclient.utils import np_to_triton_dtype

        return np_to_triton_dtype(array.dtype)

    def infer(self, model: str, tensors: Mapping[str, np.ndarray], *, request_id: str = "",
              timeout_s: float | None = None) -> dict[str, np.ndarray]:
        """One non-streamed request; raises ForgeError with the server's message."""
        done: queue.Queue = queue.Queue()
        call = self.client.async_infer(model, self._inputs(tensors), callback=lambda result, error: done.put((result, error)),
                                       request_id=request_id)
        try:
            result, error = done.get(timeout=timeout_s)
        except queue.Empty:
            call.cancel()
            raise TimeoutError(f"no answer within {timeout_s:.3f}s; request cancelled") from None
        if error is not None:
            raise ForgeError(f"the server refused the request: {_grpc_message(error)}")
        response = result.get_response()
        return {o.name: result.as_numpy(o.name) for o in response.outputs}

    def stream(self, model: str, tensors: Mapping[str, np.ndarray], *, request_id: str = "",
               stop_after_s: float | None = None) -> Iterator[StreamEvent]:
        """Send one request on the bidirectional stream and yield its responses as they arrive.

        With ``stop_after_s`` the request is cancelled after that long (the stream is closed with
        cancellation, which stops generation on the server).
        """
        if not self._streaming:
            self.client.start_stream(callback=lambda result, error: self._events.put((result, error, time.perf_counter())))
            self._streaming = True
        started = time.perf_counter()
        self.client.async_stream_infer(model, self._inputs(tensors), request_id=request_id,
                                       enable_empty_final_response=True)
        self._unanswered = True
        while True:
            timeout = None if stop_after_s is None else max(0.0, started + stop_after_s - time.perf_counter())
            try:
                result, error, at = self._events.get(timeout=timeout)
            except queue.Empty:
                self.client.stop_stream(cancel_requests=True)
                self._streaming = False
                raise TimeoutError(f"stopped after {stop_after_s * 1000:.0f} ms; request cancelled") from None
            if error is not None:
                self._unanswered = False  # an error ends the request
                raise ForgeError(f"the server refused the request: {_grpc_message(error)}")
            response = result.get_response()
            final = bool(response.parameters["triton_final_response"].bool_param) \
                if "triton_final_response" in response.parameters else True
            outputs = {o.name: result.as_numpy(o.name) for o in response.outputs}
            if final:
                self._unanswered = False
            yield StreamEvent(outputs, final, at - started, at)
            if final:
                return

    def live(self, timeout_s: float = 5.0) -> bool:
        """Whether a Triton server answers on this gRPC endpoint."""
        try:
            return bool(self.client.is_server_live(client_timeout=timeout_s))
        except Exception:
            return False

    def models(self) -> list[str]:
        """Names of the models the server knows (its repository index)."""
        index = self.client.get_model_repository_index(as_json=True)
        return sorted({m["name"] for m in index.get("models", [])})

    def send(self, inputs: ModelInputs, payload: Mapping[str, Any], *, stream: bool = False,
             stop_after_s: float | None = None) -> Iterator[StreamEvent]:
        """One request built from ``payload`` (input name → value), typed by ``inputs``; its responses."""
        tensors = {name: inputs.array(name, value) for name, value in payload.items()}
        return self.stream(inputs.name, tensors, stop_after_s=stop_after_s)


class HttpSession:
    """One keep-alive HTTP connection to a Triton server: generate / generate_stream, and plain infer.

    Text models are asked through the generate endpoints (what HTTP users of an LLM ensemble call;
    ``generate_stream`` is server-sent events); token-id models through the v2 JSON ``infer`` route.
    """

    def __init__(self, url: str, timeout_s: float = 600.0):
        parts = urllib.parse.urlsplit(http_base(url))
        self.url = f"{parts.hostname}:{parts.port or 80}"
        self._secure = parts.scheme == "https"
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or (443 if self._secure else 80)
        self._timeout = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> "HttpSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _open(self, path: str, body: Any = None, *, method: str = "POST",
              timeout_s: float | None = None) -> http.client.HTTPResponse:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._secure else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=timeout_s or self._timeout)
        self._conn.timeout = timeout_s or self._timeout
        if self._conn.sock is not None:
            self._conn.sock.settimeout(self._conn.timeout)
        data = None if body is None else json.dumps(body).encode()
        try:
            self._conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            return self._conn.getresponse()
        except (OSError, http.client.HTTPException):
            self.close()  # a dropped keep-alive connection: one fresh try
            cls = http.client.HTTPSConnection if self._secure else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=timeout_s or self._timeout)
            self._conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            return self._conn.getresponse()

    def _json(self, path: str, body: Any = None, *, method: str = "POST", timeout_s: float | None = None) -> Any:
        response = self._open(path, body, method=method, timeout_s=timeout_s)
        text = response.read().decode(errors="replace")
        if response.status != 200:
            raise ForgeError(f"the server refused the request: {_json_error(text)}")
        return json.loads(text) if text else {}

    def live(self, timeout_s: float = 5.0) -> bool:
        """Whether a Triton server answers on this HTTP endpoint."""
        try:
            response = self._open("/v2/health/live", method="GET", timeout_s=timeout_s)
            response.read()
            return response.status == 200
        except (OSError, http.client.HTTPException):
            self.close()
            return False

    def models(self) -> list[str]:
        """Names of the models the server knows (its repository index)."""
        return sorted({m["name"] for m in self._json("/v2/repository/index", {})})

    def config(self, model: str) -> ModelInputs:
        try:
            return ModelInputs.from_config(self._json(f"/v2/models/{model}/config", method="GET", timeout_s=10))
        except ForgeError as exc:
            raise ForgeError(f"model {model!r} is not available at {self.url}: "
                             f"{str(exc).removeprefix('the server refused the request: ')}") from None

    def send(self, inputs: ModelInputs, payload: Mapping[str, Any], *, stream: bool = False,
             stop_after_s: float | None = None) -> Iterator[StreamEvent]:
        """One request; text models through generate(_stream), token-id models through infer."""
        started = time.perf_counter()
        try:
            if "text_input" in payload:
                if stream:
                    yield from self._generate_stream(inputs.name, payload, started, stop_after_s)
                    return
                answer = self._json(f"/v2/models/{inputs.name}/generate", json_body(payload), timeout_s=stop_after_s)
                at = time.perf_counter()
                yield StreamEvent({k: v for k, v in answer.items() if k not in ("model_name", "model_version")},
                                  True, at - started, at)
                return
            if stream:
                raise UsageError("streaming over HTTP goes through the generate_stream endpoint of a text model; "
                                 "use --protocol grpc for token ids")
            body = {"inputs": [_json_tensor(name, inputs.inputs[name][0], inputs.array(name, value))
                               for name, value in payload.items()]}
            answer = self._json(f"/v2/models/{inputs.name}/infer", body, timeout_s=stop_after_s)
            at = time.perf_counter()
            outputs = {o["name"]: np.array(o["data"], dtype=_NUMPY.get(o["datatype"], np.object_)).reshape(o["shape"])
                       for o in answer.get("outputs", [])}
            yield StreamEvent(outputs, True, at - started, at)
        except (socket.timeout, TimeoutError):
            self.close()  # closing the connection is how an HTTP client gives up on a request
            raise TimeoutError(f"stopped after {stop_after_s * 1000:.0f} ms; request cancelled") from None

    def _generate_stream(self, model: str, payload: Mapping[str, Any], started: float,
                         stop_after_s: float | None) -> Iterator[StreamEvent]:
        response = self._open(f"/v2/models/{model}/generate_stream", json_body(payload), timeout_s=stop_after_s)
        if response.status != 200:
            raise ForgeError(f"the server refused the request: {_json_error(response.read().decode(errors='replace'))}")
        deadline = None if stop_after_s is None else started + stop_after_s
        while True:
            line = response.readline()
            if not line:
                break
            if deadline is not None and time.perf_counter() > deadline:
                raise TimeoutError
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:].decode("utf-8", errors="replace"))
            if "error" in event:
                self.close()
                raise ForgeError(f"the server refused the request: {event['error']}")
            at = time.perf_counter()
            yield StreamEvent({k: v for k, v in event.items() if k not in ("model_name", "model_version")},
                              False, at - started, at)
        at = time.perf_counter()
        yield StreamEvent({}, True, at - started, at)


def _json_error(text: str) -> str:
    try:
        return json.loads(text).get("error", text)
    except ValueError:
        return text or "no answer"


def _json_tensor(name: str, dtype: str, array: np.ndarray) -> dict[str, Any]:
    data = [v.decode() if isinstance(v, bytes) else v for v in array.reshape(-1).tolist()]
    return {"name": name, "shape": list(array.shape), "datatype": "BYTES" if dtype == "STRING" else dtype,
            "data": data}


def session(url: str, protocol: str = "grpc"):
    """A ``GrpcSession`` or ``HttpSession`` for ``url``."""
    return HttpSession(url) if protocol == "http" else GrpcSession(url)


def _grpc_message(error: Exception) -> str:
    message = getattr(error, "message", None)
    text = message() if callable(message) else str(error)
    return text.removeprefix("[StatusCode.INTERNAL] ").strip()


def text_request(inputs: ModelInputs, prompt: str, max_tokens: int, *, stream: bool = False,
                 stop_words: list[str] = (), bad_words: list[str] = (), image: bytes | None = None,
                 **sampling: Any) -> dict[str, np.ndarray]:
    """gRPC tensors for a text model (ensemble, BLS, or any model with text_input/max_tokens)."""
    payload = generate_payload(inputs, prompt, max_tokens, stop_words=stop_words, bad_words=bad_words,
                               stream=stream, image=image, **sampling)
    return {name: inputs.array(name, value) for name, value in payload.items()}
