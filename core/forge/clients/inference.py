"""A served model's inputs, typed from its own config; generate requests built from them; the gRPC client.

Inputs are typed from the served model's own config, so one client talks to repositories of every
backend profile (``max_tokens`` is UINT32 for v0.5.0 and INT32 later; ``text_input`` is ``[-1]`` or
``[1]``) and to hand-written text models that take ``text_input`` and ``max_tokens``.

``GrpcSession`` (here) and ``HttpSession`` (:mod:`.triton_http`) answer the same questions (is the server
live, which models, their configs) and send one request at a time with ``send``, yielding its responses as
they arrive, so a load generator is written once for both protocols.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np

from ..errors import ForgeError, UsageError

STREAM_CLOSE_S = 5.0  # the longest closing a session waits for the server to end its stream
#: Triton's data types as numpy's (STRING and BYTES are objects: bytes or str)
TRITON_TO_NUMPY = {"BOOL": np.bool_, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
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
GUIDE_TYPE, GUIDE = "guided_decoding_guide_type", "guided_decoding_guide"  # the LLM-API layout's guided decoding
SAMPLING_JSON = "sampling_parameters"  # Triton's vLLM backend: every sampling setting in one JSON input
#: forge infer's sampling flags → vLLM's SamplingParams fields (for SAMPLING_JSON)
VLLM_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "seed": "seed",
               "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
               "frequency_penalty": "frequency_penalty", "min_length": "min_tokens"}


def first_input(inputs: "ModelInputs", names: tuple[str, ...]) -> str | None:
    """The first of ``names`` the model takes (one meaning, named per backend release)."""
    return next((n for n in names if n in inputs.inputs), None)


def is_text_generator(inputs: "ModelInputs") -> bool:
    """Whether the model takes a prompt as text and a token budget (an ensemble, BLS or LLM-API model, or Triton's
    vLLM backend: its budget is a key of ``sampling_parameters``)."""
    return "text_input" in inputs.inputs and (first_input(inputs, MAX_TOKENS) is not None
                                              or SAMPLING_JSON in inputs.inputs)


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
        np_type = TRITON_TO_NUMPY.get(dtype)
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


def generate_payload(inputs: ModelInputs, prompt: str, max_tokens: int, *, stop_words: list[str] = (),
                     bad_words: list[str] = (), stream: bool = False, image: bytes | None = None,
                     **sampling: Any) -> dict[str, Any]:
    """The inputs of a generate request: only inputs the model has (unknown sampling flags refused).

    ``image`` (encoded bytes) goes to a multimodal ensemble's ``image`` input; JSON bodies carry it
    base64-encoded (:func:`forge.clients.triton_http.json_body`).
    """
    if not is_text_generator(inputs):
        missing = next(k for k in ("text_input", "max_tokens") if k not in inputs.inputs)
        raise UsageError(f"model {inputs.name!r} is not a text-generation model (no input {missing!r}); "
                         "point --model at the ensemble or the BLS model")
    if first_input(inputs, MAX_TOKENS) is None:
        return _sampling_json_payload(inputs, prompt, max_tokens, stop_words, bad_words, stream, image, sampling)
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


def _sampling_json_payload(inputs: "ModelInputs", prompt: str, max_tokens: int, stop_words, bad_words, stream: bool,
                           image: bytes | None, sampling: dict[str, Any]) -> dict[str, Any]:
    """A generate request of Triton's vLLM backend: the settings as SamplingParams fields in one JSON, the answer
    without the prompt unless ``exclude_input`` says otherwise."""
    import json

    if image is not None:
        raise UsageError(f"model {inputs.name!r} takes images base64-encoded in its 'image' input, which forge infer "
                         "does not send")
    values: dict[str, Any] = {"max_tokens": max_tokens}
    if stop_words:
        values["stop"] = list(stop_words)
    if bad_words:
        values["bad_words"] = list(bad_words)
    payload: dict[str, Any] = {"text_input": prompt}
    if "exclude_input_in_output" in inputs.inputs:  # the answer only, as the ensembles give it
        payload["exclude_input_in_output"] = True
    for flag, value in sampling.items():
        if value is None:
            continue
        if flag == "exclude_input":
            payload["exclude_input_in_output"] = bool(value)
        elif flag in VLLM_FIELDS:
            values[VLLM_FIELDS[flag]] = value
        else:
            raise UsageError(f"model {inputs.name!r} takes no --{flag.replace('_', '-')}")
    if values.get("top_k") == 1 and "temperature" not in values:  # greedy, as vLLM says it
        values["temperature"] = 0
    if stream and "stream" in inputs.inputs:
        payload["stream"] = True
    payload[SAMPLING_JSON] = json.dumps(values)
    return payload


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
            message = grpc_message(exc)
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
            raise ForgeError(f"the server refused the request: {grpc_message(error)}")
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
                raise ForgeError(f"the server refused the request: {grpc_message(error)}")
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


def grpc_message(error: Exception) -> str:
    """A gRPC or Triton client error as one line: its own message, without the status prefix."""
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
