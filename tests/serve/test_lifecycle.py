"""No process outlives its server (issue 35), and a dead model process never leaves requests hanging (issue 36).

Real tritonserver on CPU, started through ``forge serve`` as a user would. Each way a server can end is
tried while requests are in flight (long generations: max_tokens far above max_seq_len, clamped); then
no process of that server may remain within 15 s, and a new server on the same repository must start
and answer. The servers hand over: the new server of one test is the one the next test ends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from forge.server.processes import (describe_process, engine_processes, python_stubs, repository_processes,
                                    session_processes)

GONE_WITHIN = 15.0
PROMPT = "hello world"


def _post(url: str, body: dict, timeout: float = 60.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _generate(http: str, max_tokens: int, timeout: float = 60.0, model: str = "ensemble") -> dict:
    return _post(f"{http}/v2/models/{model}/generate",
                 {"text_input": PROMPT, "max_tokens": max_tokens, "bad_words": "", "stop_words": ""}, timeout)


class Load:
    """``n`` clients each sending long generations back to back until stopped or a request fails."""

    def __init__(self, http: str, n: int = 4, model: str = "ensemble"):
        self.http = http
        self.model = model
        self.halt = threading.Event()
        self.ended: list[tuple[float, float, str]] = []  # (sent, ended, error) of each failed request
        self.answered = 0
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(n)]
        for thread in self.threads:
            thread.start()

    def _client(self) -> None:
        while not self.halt.is_set():
            sent = time.monotonic()
            try:
                _generate(self.http, 100000, timeout=60, model=self.model)
                self.answered += 1
            except Exception as exc:  # noqa: BLE001 - any failure is how a client learns of the end
                self.ended.append((sent, time.monotonic(), f"{type(exc).__name__}: {exc}"))
                return

    def wait_busy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self.answered < len(self.threads) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.answered >= len(self.threads), f"the server answered {self.answered} requests: {self.ended}"

    def wait_ended(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ended) < len(self.threads) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self, timeout: float = 20.0) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(timeout)


class Serve:
    """``forge serve REPO`` as a subprocess of its own session, its endpoints and its tritonserver's pid."""

    def __init__(self, repo: Path):
        self.repo = repo
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from forge.cli import run; run()", "serve", str(repo), "--http-port", "0",
             "--grpc-port", "0", "--metrics-port", "0", "--no-openai", "--json",
             "--restart", "never"],  # a killed tritonserver ends forge serve (on-failure would restart it)
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        text = ""
        for line in self.proc.stdout:  # --json: one indented object, when every model is READY
            text += line
            if line.startswith("}"):
                break
        assert text, f"forge serve printed nothing: {self.proc.stderr.read()}"
        self.info = json.loads(text)
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        self.triton = next(int(pid) for pid in children if "tritonserver" in Path(f"/proc/{pid}/comm").read_text())
        self.http = self.info["http"]

    def processes(self) -> list[int]:
        """What is left of the server: tritonserver and its stubs (all in tritonserver's session)."""
        return session_processes(self.triton)

    def stubs(self) -> dict[str, int]:
        return python_stubs(self.processes())

    def end(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # ended meanwhile (a stub's reaper ends with its stub)
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture(scope="module")
def handover():
    """The running server one test leaves to the next."""
    box: dict[str, Serve] = {}
    yield box
    if "server" in box:
        box.pop("server").end()


def _gone(server: Serve, since: float) -> float:
    """Seconds from ``since`` until no process of ``server`` remains (fails after GONE_WITHIN)."""
    while time.monotonic() - since < GONE_WITHIN:
        if not server.processes():
            return time.monotonic() - since
        time.sleep(0.1)
    left = {}
    for pid in server.processes():  # the program, the model's file (a stub's first argument) and its state
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            state = next((l for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("State")), "")
            waits = {t.name: (t / "wchan").read_text() for t in Path(f"/proc/{pid}/task").iterdir()}
        except OSError:  # gone meanwhile
            continue
        left[pid] = f"{Path(args[0]).name} {args[1] if len(args) > 1 else ''} {state}; its threads wait in {waits}"
    pytest.fail(f"{len(left)} process(es) of the server outlived it by {GONE_WITHIN:.0f}s: {left}")


def _sigterm(server: Serve) -> None:
    server.proc.send_signal(signal.SIGTERM)


def _sigterm_then_sigkill(server: Serve) -> None:  # a supervisor's stop with a short grace period
    os.killpg(server.proc.pid, signal.SIGTERM)
    time.sleep(2)
    os.killpg(server.proc.pid, signal.SIGKILL)


def _sigkill_forge(server: Serve) -> None:
    server.proc.kill()


def _sigkill_tritonserver(server: Serve) -> None:
    os.kill(server.triton, signal.SIGKILL)


@pytest.mark.parametrize("end", [_sigterm, _sigterm_then_sigkill, _sigkill_forge, _sigkill_tritonserver],
                         ids=["sigterm", "sigterm-then-sigkill-2s", "sigkill-forge", "sigkill-tritonserver"])
def test_no_process_outlives_its_server(repos, handover, end):
    server = handover.pop("server", None) or Serve(repos[""])
    load = Load(server.http)
    try:
        load.wait_busy()  # every client has had an answer and has its next long generation in flight
        assert len(server.stubs()) == 3, server.stubs()
        started = time.monotonic()
        end(server)
        took = _gone(server, started)
        print(f"{end.__name__}: no process of the server left after {took:.1f}s")
        assert server.proc.wait(GONE_WITHIN) is not None
        assert repository_processes(server.repo) == [], "a process serving from the repository outlived its server"
        load.wait_ended(10)
        assert len(load.ended) == len(load.threads), "a client still waits after its server ended"
        # the python backend prints a stub's crash into the server's log (issue 36: a stop under load crashed it)
        assert "Segfault encountered" not in Path(server.info["log"]).read_text(errors="replace")
    finally:
        load.stop()
        server.end()
    again = Serve(repos[""])  # the same repository: no leftover holds it
    handover["server"] = again
    assert _generate(again.http, 4)["text_output"].startswith(PROMPT)


@pytest.mark.parametrize("end", [_sigterm, _sigkill_tritonserver], ids=["sigterm", "sigkill-tritonserver"])
def test_the_engine_process_goes_with_its_server(repos, end):
    """-o engine_process=true: the engine's own process (a child of the tensorrt_llm stub) is gone within 15 s of
    its server's end too, under load, and every client gets its answer or an error."""
    server = Serve(repos["p_"])
    load = Load(server.http, model="p_ensemble")
    try:
        load.wait_busy()
        engines = list(engine_processes(server.processes()))
        assert len(engines) == 1 and python_stubs(server.processes()).get("p_tensorrt_llm"), server.processes()
        started = time.monotonic()
        end(server)
        took = _gone(server, started)
        print(f"{end.__name__}: the engine process and the rest of the server gone after {took:.1f}s")
        assert server.proc.wait(GONE_WITHIN) is not None  # forge serve itself names the repository too
        assert [describe_process(pid) for pid in repository_processes(server.repo)] == [], \
            "a process serving from the repository outlived its server"
        load.wait_ended(10)
        assert len(load.ended) == len(load.threads), "a client still waits after its server ended"
    finally:
        load.stop()
        server.end()


def test_serve_refuses_a_repository_with_leftover_processes(repos, handover, tmp_path):
    """A stub whose tritonserver is gone (as issue 35 left one) is named, and the server does not start."""
    repo = repos[""].resolve()
    fake = subprocess.Popen([str(tmp_path / "triton_python_backend_stub"), "-c", "import time; time.sleep(120)",
                             str(repo / "tensorrt_llm" / "1" / "model.py")], executable=sys.executable)
    try:
        done = subprocess.run([sys.executable, "-c", "from forge.cli import run; run()", "serve", str(repo),
                               "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--no-openai"],
                              capture_output=True, text=True, timeout=120)
    finally:
        fake.kill()
        fake.wait()
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("forge: error")]
    assert len(errors) == 1 and str(fake.pid) in errors[0], done.stderr


def test_requests_on_a_dead_model_process_get_an_error(repos):
    """kill -9 of the tensorrt_llm stub with 8 requests in flight: each gets an error within 10 s (the
    supervisor restarts tritonserver, which closes their connections), and requests succeed again after."""
    from forge.server.triton_server import TritonServer
    from forge.server.supervisor import Supervisor, stub_processes

    with TritonServer(repos[""]) as server, Supervisor(server, interval=0.25) as supervisor:
        http = f"http://{server.http_url}"
        load = Load(http, n=8)
        try:
            load.wait_busy()
            stub = next(pid for pid, model in stub_processes(server).items() if model == "tensorrt_llm")
            deadline = time.monotonic() + 10
            while stub not in supervisor.watching() and time.monotonic() < deadline:  # it polls every 0.25 s
                time.sleep(0.05)
            assert supervisor.watching().get(stub) == "tensorrt_llm", f"the supervisor sees {supervisor.watching()}"
            killed = time.monotonic()
            os.kill(stub, signal.SIGKILL)
            load.wait_ended(10)
            late = [e for e in load.ended if e[1] - killed > 10]
            assert len(load.ended) == 8 and not late, f"{8 - len(load.ended)} requests hung: {load.ended}"
            print(f"every in-flight request failed within {max(e[1] for e in load.ended) - killed:.1f}s")
        finally:
            load.stop()
        assert supervisor.deaths and supervisor.deaths[0] == (stub, "tensorrt_llm")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # back once the restarted server's models are READY
            try:
                assert _generate(http, 4, timeout=30)["text_output"].startswith(PROMPT)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.5)
        else:
            pytest.fail("the restarted server did not answer within 120 s")
    # stopped idle, after the restart: no model process crashed on the way out
    assert "Segfault encountered" not in Path(server.log_file).read_text(errors="replace")


def test_code_about_to_call_a_dead_server_ends_the_process_first(tmp_path):
    """``forge_glue.exit_if_orphaned``: with the watched process gone, the caller's process exits (status 1,
    one line saying why) before it can block on the dead server; with it alive, nothing happens."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    code = ("import sys, time\n"
            "from forge.in_triton import forge_glue\n"
            "forge_glue.exit_with_parent(also=[int(sys.argv[1])], interval=3600, what='test process')\n"
            "forge_glue.exit_if_orphaned()\n"
            "print('still here')\n")
    alive = subprocess.run([sys.executable, "-c", code, str(os.getpid())], capture_output=True, text=True, timeout=60)
    assert alive.returncode == 0 and alive.stdout.strip() == "still here", alive.stderr
    gone = subprocess.run([sys.executable, "-c", code, str(dead.pid)], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "still here" not in gone.stdout
    assert "forge: test process" in gone.stderr and f"exits: process {dead.pid} exited" in gone.stderr
