"""The OpenAI API (chat, completions, embeddings, models) in front of a tritonserver that forge serve started.

It talks gRPC to that server and imports no decoder code, so it serves every target the same way.
:class:`OpenAIServer` runs the FastAPI application under uvicorn on a thread of its own.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from ..errors import ForgeError

DEFAULT_PORT = 9000


class OpenAIServer:
    """uvicorn serving the OpenAI API of ``repo`` on ``host:port`` (0: a free port), in a background thread;
    ``metrics_url`` (tritonserver's metrics endpoint) gives ``/metrics`` the requests waiting and running."""

    def __init__(self, repo: Path, grpc_url: str, *, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 served_model_name: str | None = None, api_key: str | None = None, metrics_url: str | None = None):
        self.repo = Path(repo)
        self.grpc_url = grpc_url
        self.metrics_url = metrics_url
        self.host = host
        self.port = port
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.catalog = None
        self.front = None
        self._server = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}/v1"

    def _bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise ForgeError(f"the OpenAI API cannot listen on {self.host}:{self.port}: {exc.strerror}",
                             hint="pass --openai-port PORT (0: a free port) or --no-openai") from None
        sock.listen(2048)
        sock.set_inheritable(True)
        self.port = sock.getsockname()[1]
        return sock

    def start(self, timeout: float = 30.0) -> "OpenAIServer":
        import uvicorn

        from . import catalog as catalog_mod
        from .app import Front, create_app

        self.catalog = catalog_mod.load(self.repo, self.served_model_name)
        self._socket = self._bind()
        self.front = Front(self.catalog, self.grpc_url, self.api_key, self.metrics_url)
        app = create_app(self.front)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="forge-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ForgeError(f"the OpenAI API did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def drain(self, timeout: float) -> int:
        """Take no new requests (503 with Retry-After, /health/ready 503) and wait up to ``timeout`` s for
        those in flight (streams to their end); how many are still in flight (0: drained)."""
        if self.front is None:
            return 0
        self.front.draining = True
        time.sleep(0.05)  # a request that passed the check just before counts itself in by now
        self.front.idle.wait(max(timeout, 0.0))
        return self.front.in_flight

    def recovering(self, models: list[str], reason: str) -> int:
        """The processes of ``models`` died (any thread): fail the requests in flight on them (503 with
        ``reason``), hold new ones and answer /health/ready 503 until ``recovered``; how many were failed."""
        return self._on_loop(lambda triton: triton.recovering(models, reason), 0)

    def recovered(self, models: list[str]) -> None:
        """``models`` are back (loaded again, or tritonserver restarted): the requests held go on."""
        self._on_loop(lambda triton: triton.recovered(models), None)

    def _on_loop(self, work, default):
        import concurrent.futures

        front = self.front
        if front is None or front.loop is None or front.loop.is_closed() or front.triton is None:
            return default
        done: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(work(front.triton))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                done.set_exception(exc)

        try:
            front.loop.call_soon_threadsafe(run)
            return done.result(timeout=10)
        except (RuntimeError, concurrent.futures.TimeoutError):  # the loop stopped meanwhile
            return default

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
