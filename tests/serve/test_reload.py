"""Loading one model again (forge serve's recovery of a dead model process) holds up no other model's clients.

A real tritonserver serves the LLM-API model of the tiny GPT-2 (``ls_``: decoupled, streaming) and a python model
whose process takes LOAD_S to start. While clients stream from the first through Triton's HTTP endpoint,
``recovery.reload`` loads the slow one again. tritonserver answers a model-control request on the thread that
took it: over HTTP that thread is one of those the HTTP clients' streams share, which then wait for the whole
load. forge sends it over gRPC, so no stream waits.
"""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

LOAD_S = 6.0
SLOW_MODEL = '''
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(float(open(args["model_repository"] + "/load_seconds").read()))

    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
'''
SLOW_CONFIG = '''name: "slow"
backend: "python"
max_batch_size: 0
input [{ name: "x" data_type: TYPE_FP32 dims: [1] }]
output [{ name: "y" data_type: TYPE_FP32 dims: [1] }]
'''


@pytest.fixture(scope="module")
def server(repos, tmp_path_factory):
    from forge.server.triton_server import TritonServer

    root = tmp_path_factory.mktemp("reload")
    repo = Path(shutil.copytree(repos["ls_"], root / "repo"))
    slow = repo / "slow"
    (slow / "1").mkdir(parents=True)
    (slow / "1" / "model.py").write_text(SLOW_MODEL)
    (slow / "config.pbtxt").write_text(SLOW_CONFIG)
    (slow / "load_seconds").write_text("0")
    with TritonServer(repo, log_file=root / "tritonserver.log", startup_timeout=900.0) as running:
        (slow / "load_seconds").write_text(str(LOAD_S))
        yield running


class Streams:
    """``n`` clients streaming from ``ls_tensorrt_llm`` over HTTP, back to back: the longest wait for a chunk."""

    def __init__(self, http_url: str, n: int = 8):
        self.host, self.port = http_url.rsplit(":", 1)
        self.halt = threading.Event()
        self.waits: list[tuple[float, float]] = []  # (longest wait for a chunk, when it ended) per request
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(n)]
        for thread in self.threads:
            thread.start()

    def _client(self) -> None:
        body = json.dumps({"text_input": "hello world", "sampling_param_max_tokens": 16, "streaming": True})
        while not self.halt.is_set():
            connection = http.client.HTTPConnection(self.host, int(self.port), timeout=60)
            last = time.monotonic()
            longest = 0.0
            try:
                connection.request("POST", "/v2/models/ls_tensorrt_llm/generate_stream", body=body)
                response = connection.getresponse()
                assert response.status == 200, response.read()[:200]
                for line in iter(response.readline, b""):
                    if line.strip():
                        now = time.monotonic()
                        longest, last = max(longest, now - last), now
                        if b'"error"' in line:
                            self.errors.append(line[:200].decode(errors="replace"))
                self.waits.append((longest, time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - counted, the test fails on it
                self.errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                connection.close()

    def stop(self) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(90)


def test_loading_a_model_again_holds_up_no_stream_of_another(server):
    from forge.server import recovery

    streams = Streams(server.http_url)
    try:
        time.sleep(2.0)
        assert streams.waits, streams.errors
        started = time.monotonic()
        recovery.reload(server, "slow")
        took = time.monotonic() - started
        time.sleep(1.0)
    finally:
        streams.stop()
    assert took >= LOAD_S, f"the load took {took:.1f} s"
    assert not streams.errors, streams.errors[:3]
    during = [wait for wait, ended in streams.waits if ended > started]
    assert during, "no stream ended during the load"
    assert max(during) < LOAD_S / 2, (f"a stream of the other model waited {max(during):.1f} s for a chunk while "
                                      f"the slow model loaded ({took:.1f} s)")
    assert {m["name"]: m.get("state") for m in server.models()}["slow"] == "READY"


def test_a_model_that_cannot_load_again_is_said_in_one_line(server):
    from forge.errors import ForgeError
    from forge.server import recovery

    config = Path(server.repo) / "slow" / "config.pbtxt"
    kept = config.read_text()
    config.write_text(kept.replace('backend: "python"', 'backend: "python"\nparameters: bogus'))
    try:
        with pytest.raises(ForgeError, match=r"could not load model 'slow' again: ") as raised:
            recovery.reload(server, "slow")
        assert "\n" not in str(raised.value)
    finally:
        config.write_text(kept)
    recovery.reload(server, "slow")
