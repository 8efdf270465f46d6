"""Triton's HTTP endpoints: model configs, the repository index, generate / generate_stream and v2 JSON infer.

``generate`` and friends are one-shot calls (``forge infer --protocol http``); :class:`HttpSession` keeps
one connection alive and answers what :class:`~forge.clients.inference.GrpcSession` does, so a load
generator sends over either protocol alike.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterator, Mapping

import numpy as np

from ..errors import ForgeError, UsageError
from .inference import TRITON_TO_NUMPY, ModelInputs, StreamEvent, is_text_generator


def http_base(url: str) -> str:
    return url if url.startswith(("http://", "https://")) else f"http://{url}"


def model_config(http_url: str, model: str, timeout: float = 10.0) -> dict[str, Any]:
    """The served model's config (Triton's JSON form)."""
    url = f"{http_base(http_url)}/v2/models/{model}/config"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise ForgeError(f"model {model!r} is not served at {http_url}: {_error_text(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise _unreachable(http_url, exc) from None


def _unreachable(http_url: str, exc: Exception) -> ForgeError:
    return ForgeError(f"cannot reach a Triton server at {http_url}: {getattr(exc, 'reason', exc)}",
                      hint="start one with 'forge serve REPO' or pass --url")


def text_model(http_url: str, timeout: float = 10.0) -> str:
    """The model a text request goes to when none is named: ``ensemble``, else the one text generator served."""
    url = f"{http_base(http_url)}/v2/repository/index"
    try:
        request = urllib.request.Request(url, data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            names = sorted({m["name"] for m in json.loads(response.read()) if m.get("state", "READY") == "READY"})
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise _unreachable(http_url, exc) from None
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
        raise _unreachable(http_url, exc) from None


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
            outputs = {o["name"]: np.array(o["data"], dtype=TRITON_TO_NUMPY.get(o["datatype"], np.object_))
                       .reshape(o["shape"]) for o in answer.get("outputs", [])}
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
