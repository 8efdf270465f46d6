"""An engine process's hand-over to its model's next python stub (forge_decoder/adoption.py), on real unix sockets
and real processes; forge serve's whole path (kill -9 of a stub, its engine taken over) is test_recovery.py's.

Bad inputs tried: no in-flight directory, adoption turned off, a socket path too long for a unix socket, no
engine listening, an engine that refuses (another configuration), a stub that connects and says nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("torch")

from forge.in_triton.python_target.forge_decoder import adoption  # noqa: E402

CONFIG = {"name": "tensorrt_llm", "parameters": {"max_seq_len": {"string_value": "64"}}}


@pytest.fixture
def in_flight(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGE_INFLIGHT_DIR", str(tmp_path))
    monkeypatch.delenv("FORGE_ENGINE_ADOPTION", raising=False)
    return tmp_path


def test_no_socket_without_forge_serve_or_when_turned_off(tmp_path, monkeypatch):
    monkeypatch.delenv("FORGE_INFLIGHT_DIR", raising=False)
    assert adoption.socket_path("m") is None
    monkeypatch.setenv("FORGE_INFLIGHT_DIR", str(tmp_path))
    assert adoption.socket_path("m") == str(tmp_path / "m.engine")
    monkeypatch.setenv("FORGE_ENGINE_ADOPTION", "0")
    assert adoption.socket_path("m") is None
    monkeypatch.setenv("FORGE_ENGINE_ADOPTION", "1")
    assert adoption.socket_path("m" * 120) is None  # past a unix socket's path limit: no adoption, no error


def test_a_stub_finds_no_engine_and_starts_its_own(in_flight):
    assert adoption.adopt(adoption.socket_path("m"), CONFIG, "/repo/m/1", "m") is None
    (in_flight / "m.engine").write_text("not a socket")
    assert adoption.adopt(adoption.socket_path("m"), CONFIG, "/repo/m/1", "m") is None


def _engine(path: str, identity: tuple, result: list) -> threading.Thread:
    """An engine's side of the hand-over on a thread: accepts a stub asking with ``identity``, then says ready."""
    server = adoption.listen(path)

    def accept(config, here, name):
        return None if (config, here) == identity else f"loaded from another configuration of {name!r}"

    def run():
        conn = adoption.wait_for_stub(server, accept, timeout=20)
        result.append(conn)
        if conn is not None:
            conn.send(("ready", "limits", "summary", "graphs", True, os.getpid()))
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_next_stub_takes_over_an_engine_loaded_the_same_way(in_flight):
    path, result = adoption.socket_path("m"), []
    engine = _engine(path, (CONFIG, "/repo/m/1"), result)
    conn, figures = adoption.adopt(path, CONFIG, "/repo/m/1", "m")
    engine.join(20)
    assert figures == ("limits", "summary", "graphs", True, os.getpid()) and result[0] is not None
    conn.send(("ack",))
    assert result[0].recv() == ("ack",)  # the engine now talks to the new stub
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"


def test_an_engine_of_another_configuration_is_refused_and_the_stub_waits_for_it_to_exit(in_flight, monkeypatch):
    # the refusing engine names its pid; the stub waits for that process to end before it loads a new one
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    monkeypatch.setattr(adoption.os, "getpid", lambda: exiting.pid)
    path, result = adoption.socket_path("m"), []
    engine = _engine(path, ({**CONFIG, "max_batch_size": 8}, "/repo/m/1"), result)
    assert adoption.adopt(path, CONFIG, "/repo/m/1", "m") is None
    engine.join(20)
    assert result == [None] and exiting.poll() is not None


def test_an_engine_gives_up_on_a_stub_that_says_nothing(in_flight, monkeypatch):
    import socket

    monkeypatch.setattr(adoption, "HANDSHAKE_S", 0.5)
    path, result = adoption.socket_path("m"), []
    engine = _engine(path, (CONFIG, "/repo/m/1"), result)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(path)
    engine.join(20)
    silent.close()
    assert result == [None]


def test_an_adopted_engine_s_end_is_read_from_its_zombie():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    adopted = adoption.Adopted(child.pid)
    assert adopted.poll() is None
    os.kill(child.pid, signal.SIGKILL)
    assert adopted.wait(10) == -signal.SIGKILL  # read while it is a zombie (we have not reaped it)
    child.wait()
    assert adoption.Adopted(child.pid).poll() == -1  # reaped: gone, its status no longer readable
