"""An engine process that outlives its python stub, so that the model's next stub takes it over loaded.

A stub that dies (a crash, ``kill -9``, the OOM killer) leaves its engine process (``-o engine_process``)
with the model loaded and, on a GPU, its CUDA graphs captured: loading that again takes most of a reload.
Under ``forge serve`` (which sets ``FORGE_INFLIGHT_DIR`` and loads a dead model again alone), the engine
process therefore does not end with its stub: it fails what the stub held and listens on a unix socket
(``$FORGE_INFLIGHT_DIR/<model>.engine``) for ``ADOPT_WAIT_S``. The model's next stub connects first: when the
engine was loaded from the same model directory with the same configuration, it serves the new stub at once;
otherwise (or when nobody comes) it exits. It always ends with tritonserver, and a stub that stops it on
purpose (an unload) stops it for good.

Handshake on the socket, pickled messages: stub → engine ``("adopt", config, here, name)``; engine → stub
``("ready", limits, summary, graphs, timed, pid)`` or ``("refused", why, pid)``, after which that engine exits
and the stub, once it has, starts a new one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from multiprocessing.connection import Connection

ADOPT_WAIT_S = 120.0  # how long an engine whose stub died waits for the next one
HANDSHAKE_S = 30.0  # how long either side waits for the other's half of the handshake
SERVER_PID = "FORGE_ENGINE_SERVER_PID"  # tritonserver's pid, for the engine process to end with it
SOCKET = "FORGE_ENGINE_SOCKET"  # where an engine process listens once its stub is gone (unset: it ends with it)


def socket_path(name: str) -> str | None:
    """Where the engine of model ``name`` listens once its stub is gone; None: no adoption (not under forge
    serve, or the path is too long for a unix socket)."""
    directory = os.environ.get("FORGE_INFLIGHT_DIR")
    if not directory or os.environ.get("FORGE_ENGINE_ADOPTION", "1") == "0":
        return None
    path = os.path.join(directory, f"{name}.engine")
    return path if len(path.encode()) < 100 else None


def listen(path: str) -> socket.socket:
    """The engine's listening socket (a stale one of an engine before it is replaced)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o600)
    server.listen(1)
    return server


def wait_for_stub(server: socket.socket, accept, timeout: float = ADOPT_WAIT_S) -> Connection | None:
    """The engine's side: the connection of the first stub ``accept(config, here, name)`` takes (True) within
    ``timeout`` s; None when none came or one was refused (the engine then exits)."""
    server.settimeout(max(0.1, timeout))
    try:
        sock, _ = server.accept()
    except OSError:  # timed out (or closed)
        return None
    sock.settimeout(None)
    conn = Connection(sock.detach())
    try:
        if not conn.poll(HANDSHAKE_S):
            conn.close()
            return None
        message = conn.recv()
    except (EOFError, OSError):
        conn.close()
        return None
    if message[0] != "adopt":
        conn.close()
        return None
    why = accept(*message[1:])
    if why is not None:
        try:
            conn.send(("refused", why, os.getpid()))
        finally:
            conn.close()
        return None
    return conn


def adopt(path: str | None, config: dict, here: str, name: str) -> tuple[Connection, tuple] | None:
    """The stub's side: a waiting engine's connection and its ``ready`` figures, or None (spawn a new one)."""
    if path is None or not os.path.exists(path):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(5.0)
        sock.connect(path)
        sock.settimeout(None)
    except OSError:
        sock.close()
        return None
    conn = Connection(sock.detach())
    try:
        conn.send(("adopt", config, here, name))
        while conn.poll(HANDSHAKE_S):
            message = conn.recv()
            if message[0] == "ready":
                return conn, message[1:]
            if message[0] == "refused":  # it exits: its memory (a GPU's) is free before a new one loads
                with contextlib.suppress(Exception):
                    Adopted(message[2]).wait(HANDSHAKE_S)
            if message[0] != "log":
                break
    except (EOFError, OSError):
        pass
    conn.close()
    return None


class Adopted:
    """What ``EngineHost`` keeps of an engine process it did not start: the ``subprocess.Popen`` calls it makes
    (``poll``, ``wait``, ``kill``, ``returncode``), by pid. Its status as ``Popen`` gives it (-N: killed by signal
    N) is read from the zombie it leaves under tritonserver (forge serve makes tritonserver their reaper); -1 where
    the ended process is already gone."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _ended(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"engine process {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


def _ended(pid: int) -> int | None:
    """None while ``pid`` runs; its exit status once it ended (Popen's form), -1 where that is not readable."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return -1
    fields = text[text.rfind(")") + 2:].split()
    if fields[0] not in ("Z", "X"):
        return None
    if len(fields) < 50:  # no exit_code field (Linux < 3.5)
        return -1
    status = int(fields[-1])
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
