"""SIGTERM (and SIGINT) drains forge serve: requests in flight finish, new ones are refused, exit status 0.

A real tritonserver on CPU serving a tiny random GPT-2 built with ``--decoupled`` (streaming) and a long
sequence limit, so that a greedy stream of ~900 tokens lasts seconds. ``forge serve`` gets SIGTERM while an
OpenAI chat stream and a stream straight to Triton's HTTP ``generate_stream`` are in flight.
"""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from serve_models import make_gpt2

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

MAX_TOKENS = 900


@pytest.fixture(scope="module")
def long_repo(tmp_path_factory) -> Path:
    """A decoupled build whose streams may run to 1000 tokens (a chat template added to the tokenizer)."""
    from forge.cli import main

    root = tmp_path_factory.mktemp("drain")
    model = make_gpt2(root / "gpt2", n_positions=1024, n_layer=8, n_embd=256)  # 900 tokens take seconds
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    out = root / "repo"
    argv = ["build", "--backend-version", ENGINE, "--family", "gpt", "--model", str(model), "--dtype", "float32", "--out", str(out),
            "-o", "compute_dtype=float32", "--target", "python", "--decoupled", "--max-input-len", "64",
            "--max-seq-len", "1024", "--max-batch-size", "4"]
    assert main(argv) == 0
    return out


class Stream:
    """One streamed POST read line by line on a thread: the ``data:`` events and when the last one came."""

    def __init__(self, url: str, body: dict):
        self.url, self.body = url, body
        self.events: list[str] = []
        self.ended: float | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        request = urllib.request.Request(self.url, data=json.dumps(self.body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                for line in response:
                    line = line.decode().strip()
                    if line.startswith("data:"):
                        self.events.append(line[5:].strip())
        except Exception as exc:  # noqa: BLE001 - reported by the assertions
            self.error = f"{type(exc).__name__}: {exc}"
        self.ended = time.monotonic()

    def wait_started(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < 3 and self.ended is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(self.events) >= 3 and self.ended is None, (self.events[:3], self.error)


def _status(url: str, body: dict | None = None) -> tuple[int, dict, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def _log_tail(info: dict, lines: int = 40) -> str:
    """The end of tritonserver's log, for a failed drain's message (which model it waited on)."""
    try:
        text = Path(info["log"]).read_text(errors="replace")
    except (KeyError, OSError) as exc:
        return f"\n(no tritonserver log: {exc})"
    return "\ntritonserver log, last lines:\n" + "\n".join(text.splitlines()[-lines:])


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _serve(repo: Path, drain_timeout: int, *, sigint_ignored: bool = False) -> tuple[subprocess.Popen, dict]:
    """``forge serve --json`` of ``repo`` on free ports: the process and its endpoints once it printed them.
    ``sigint_ignored``: started as a script's background job is, with SIGINT ignored."""
    serve = subprocess.Popen([sys.executable, "-c", "from forge.cli import run; run()", "serve", str(repo),
                              "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "0",
                              "--drain-timeout", str(drain_timeout), "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=_ignore_sigint if sigint_ignored else None)
    text = ""
    for line in serve.stdout:
        text += line
        if line.rstrip() == "}":
            break
    if not text:
        serve.kill()
        pytest.fail(f"forge serve did not start: {serve.stderr.read()}")
    return serve, json.loads(text)


def test_sigterm_drains_streams_in_flight_and_refuses_new_requests(long_repo):
    serve, info = _serve(long_repo, 20)
    try:
        base = info["openai"].removesuffix("/v1")
        model = info["openai_models"][0]
        chat_body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "temperature": 0,
                     "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
        chat = Stream(f"{base}/v1/chat/completions", chat_body)
        triton = Stream(f"{info['http']}/v2/models/ensemble/generate_stream",
                        {"text_input": "hello", "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
                       "return_num_output_tokens": True})
        chat.wait_started()
        triton.wait_started()

        serve.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        status, headers, error = _status(f"{base}/v1/chat/completions", {**chat_body, "stream": False})
        refused = time.monotonic()
        assert status == 503 and headers.get("retry-after") == "5", (status, error)
        assert error["error"]["code"] == "server_shutting_down"
        assert _status(f"{base}/health/ready")[0] == 503
        # tritonserver's HTTP port takes no new request either (it closes new connections unanswered)
        host, port = info["http"].removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            connection.request("GET", "/v2/health/ready")
            connection.getresponse()
        connection.close()

        chat.thread.join(60)
        triton.thread.join(60)
        assert chat.error is None and triton.error is None, (chat.error, triton.error)
        assert chat.ended > refused, "the chat stream ended before the drain was tested"
        assert chat.events[-1] == "[DONE]"
        last_chunk, usage = json.loads(chat.events[-3]), json.loads(chat.events[-2])
        assert last_chunk["choices"][0]["finish_reason"] == "length"
        assert usage["usage"]["completion_tokens"] == MAX_TOKENS
        assert json.loads(triton.events[-1])["num_output_tokens"] == MAX_TOKENS
        status = serve.wait(60)
        stderr = serve.stderr.read()
        assert status == 0 and "drained and stopped" in stderr, stderr + _log_tail(info)
        print(f"the chat stream ended {chat.ended - refused:.1f} s after a new request was refused; {stderr}")
    finally:
        if serve.poll() is None:
            import os

            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


class Reconnecting:
    """A client sending short Triton ``generate_stream`` requests back to back, reconnecting after each.

    Outcomes: ``done`` (the stream's last event came), ``refused`` (no connection, or an error before any event)
    and ``cut`` (the stream began and then broke off: what a drain must never do).
    """

    def __init__(self, http: str):
        self.http = http
        self.outcomes = {"done": 0, "refused": 0, "cut": []}
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.halt.is_set():
            stream = Stream(f"{self.http}/v2/models/ensemble/generate_stream",
                            {"text_input": "hello", "max_tokens": 40, "temperature": 0.0, "stream": True,
                             "return_num_output_tokens": True})
            stream.thread.join(120)
            last = json.loads(stream.events[-1]) if stream.events else {}
            if stream.error is None and last.get("num_output_tokens") == 40:
                self.outcomes["done"] += 1
            elif not stream.events:
                self.outcomes["refused"] += 1
                time.sleep(0.1)
            else:
                self.outcomes["cut"].append((len(stream.events), stream.error))


@pytest.mark.heavy
def test_sigterm_waits_for_tritons_own_streams_while_clients_keep_reconnecting(long_repo):
    """A long stream straight to Triton's HTTP port, while clients keep reconnecting: the stream runs to its end (a
    stopping tritonserver keeps its open HTTP connections served before it stops its schedulers), every new
    connection is refused rather than cut off mid-stream, and forge serve exits 0 long before its drain timeout."""
    serve, info = _serve(long_repo, 30)
    clients: list[Reconnecting] = []
    try:
        clients = [Reconnecting(info["http"]) for _ in range(3)]
        long = Stream(f"{info['http']}/v2/models/ensemble/generate_stream",
                      {"text_input": "hello", "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
                       "return_num_output_tokens": True})
        long.wait_started()
        signalled = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        long.thread.join(60)
        status = serve.wait(60)
        stopped = time.monotonic()
        stderr = serve.stderr.read()
        for client in clients:
            client.halt.set()
            client.thread.join(60)
        assert long.error is None and json.loads(long.events[-1])["num_output_tokens"] == MAX_TOKENS, long.error
        assert long.ended > signalled + 1, "the long stream ended before the drain was tested"
        assert [c.outcomes["cut"] for c in clients] == [[], [], []]
        assert all(c.outcomes["refused"] for c in clients), [c.outcomes for c in clients]
        assert status == 0 and "drained and stopped" in stderr, stderr + _log_tail(info)
        assert stopped - signalled < 25, "the drain ran to its timeout"
        print(f"the long stream ended {long.ended - signalled:.1f} s after SIGTERM; "
              f"{[c.outcomes for c in clients]}; {stderr.strip().splitlines()[-1]}")
    finally:
        for client in clients:
            client.halt.set()
        if serve.poll() is None:
            import os

            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


def test_sigint_drains_a_server_started_with_sigint_ignored(long_repo):
    """``forge serve ... &`` in a script starts with SIGINT ignored (the shell's rule for background jobs), where
    Python raises no KeyboardInterrupt: ``kill -INT`` must still drain and stop it, not leave it running."""
    serve, info = _serve(long_repo, 10, sigint_ignored=True)
    try:
        serve.send_signal(signal.SIGINT)
        status = serve.wait(60)
        stderr = serve.stderr.read()
        assert status == 0 and "drained and stopped" in stderr, stderr + _log_tail(info)
    finally:
        if serve.poll() is None:
            import os

            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()
