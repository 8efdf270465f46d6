"""forge serve brings back the one model whose process died while the repository's other models serve on.

One ``forge serve`` (real tritonserver, the OpenAI API in front) of a repository of three builds of the tiny
GPT-2: ``p_`` (the ensemble the OpenAI API serves, its decoder's engine in a process of its own), ``s_`` (a
decoupled ensemble) and ``l_`` (an LLM-API model, not decoupled). Clients load ``l_tensorrt_llm`` straight
through Triton's HTTP endpoint throughout, and must see no error at all. In order:

1. kill -9 of ``p_tensorrt_llm``'s process under streamed OpenAI load: the API's requests on it fail at
   once with a 503, only that model is loaded again, and the API answers again within seconds; its engine
   process outlives it, and the model's new process takes it over loaded;
2. kill -9 of that engine process: the same, through the model process that outlived it;
3. kill -9 of ``s_tensorrt_llm``'s process while it holds clients' streams through Triton itself: those requests
   can only be released by a restart of tritonserver, so forge serve restarts it; the API is ready within a
   second of tritonserver, and the log keeps the first server's lines under their own header;
4. on a server of its own, kill -9 of ``p_tensorrt_llm``'s process under streamed OpenAI load, then SIGTERM:
   tritonserver never unloads the dead process's generation of the model (the API's requests in it are never
   released), so forge serve ends tritonserver once only that generation is left, and the drain is clean.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from forge.in_triton.forge_glue import IN_FLIGHT_DIR, InFlight
from forge.server.processes import engine_model, engine_processes, python_stubs, session_processes

PROMPT = "hello world"


def _post(url: str, body: dict, timeout: float = 30.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


class Served:
    """``forge serve`` of the repository, with the OpenAI API and a log file."""

    def __init__(self, repo: Path, log: Path):
        self.repo, self.log = repo, log
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from forge.cli import run; run()", "serve", str(repo), "--http-port", "0",
             "--grpc-port", "0", "--metrics-port", "0", "--openai-port", "0", "--served-model-name", "tiny",
             "--json", "--log-file", str(log)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        lines = [self.proc.stdout.readline()]
        while lines[-1] and lines[-1].rstrip() != "}":
            lines.append(self.proc.stdout.readline())
        assert lines[-1], f"forge serve printed nothing: {self.proc.stderr.read()}"
        self.info = json.loads("".join(lines))
        self.http, self.api = self.info["http"], self.info["openai"].removesuffix("/v1")
        self.stderr: list[str] = []
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def tritonserver(self) -> int:
        # a restarted one is the child of the supervisor's thread
        children = [pid for task in Path(f"/proc/{self.proc.pid}/task").iterdir()
                    for pid in (task / "children").read_text().split()]
        return next(int(pid) for pid in children if "tritonserver" in Path(f"/proc/{pid}/comm").read_text())

    def stub(self, model: str) -> int:
        return python_stubs(session_processes(self.tritonserver()))[model]

    def in_flight(self, model: str) -> tuple[int, str]:
        """(pid, the file of the requests only it can answer) of ``model``'s process: the count it keeps for
        forge serve (forge_glue.InFlight; read it with ``InFlight.read``)."""
        pid = self.stub(model)
        environ = dict(item.split("=", 1) for item in
                       Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        return pid, InFlight.path(environ.get(IN_FLIGHT_DIR, "/nonexistent"), model, pid)

    def engine(self, model: str) -> int:
        """The engine process of ``model``: its stub's child, or one its stub took over (tritonserver's child)."""
        engines = engine_processes(session_processes(self.tritonserver()))
        stub = self.stub(model)
        (pid,) = [pid for pid, parent in engines.items() if parent == stub or engine_model(pid) == model]
        return pid

    def said(self, text: str, since: int = 0, timeout: float = 60.0) -> str:
        """The last line forge serve printed with ``text`` in it, from line ``since`` on."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [line for line in self.stderr[since:] if text in line]
            if found:
                return found[-1]
            time.sleep(0.1)
        raise AssertionError(f"forge serve did not say {text!r}: {''.join(self.stderr)[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Direct:
    """Clients of ``l_tensorrt_llm`` through Triton's HTTP generate endpoint, back to back until stopped."""

    def __init__(self, served: Served, n: int = 2):
        self.served = served
        self.halt = threading.Event()
        self.answered = 0
        self.failures: list[tuple[float, str]] = []
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(n)]
        for thread in self.threads:
            thread.start()

    def _client(self) -> None:
        while not self.halt.is_set():
            try:
                status, body = _post(f"{self.served.http}/v2/models/l_tensorrt_llm/generate",
                                     {"text_input": PROMPT, "sampling_param_max_tokens": 8})
            except OSError as exc:
                status, body = 0, str(exc).encode()
            if status == 200 and json.loads(body)["text_output"]:
                self.answered += 1
            else:
                self.failures.append((time.monotonic(), f"{status}: {body[:200]!r}"))
                time.sleep(0.2)

    def stop(self) -> None:
        self.halt.set()
        for thread in self.threads:
            thread.join(60)


class Streams:
    """``n`` streamed OpenAI completions of the served model, each as long as the model allows."""

    def __init__(self, served: Served, n: int = 3):
        import openai

        self.client = openai.OpenAI(base_url=served.info["openai"], api_key="unused", max_retries=0, timeout=120)
        self.chunks = [0] * n
        self.ended: list[tuple[float, str]] = []  # (when, how) of each stream
        self.threads = [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(n)]
        for thread in self.threads:
            thread.start()

    def _stream(self, index: int) -> None:
        try:
            for _chunk in self.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100, stream=True,
                                                         extra_body={"ignore_eos": True}):
                self.chunks[index] += 1
                time.sleep(0.05)  # a slow reader: the stream is still open when its model's process dies
            self.ended.append((time.monotonic(), "finished"))
        except Exception as exc:  # noqa: BLE001 - how the client learns its model died
            self.ended.append((time.monotonic(), f"{type(exc).__name__}: {exc}"))

    def wait_streaming(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.chunks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(self.chunks), f"not every stream started: {self.chunks} {self.ended}"

    def wait_ended(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)


@pytest.fixture(scope="module")
def served(repos, tmp_path_factory):
    from forge.testing import merge_repositories

    root = tmp_path_factory.mktemp("recovery")
    repo = merge_repositories([repos["p_"], repos["s_"], repos["l_"]], root / "repo")
    shutil.copy(repos["p_"] / "forge-manifest.json", repo / "forge-manifest.json")
    server = Served(repo, root / "triton.log")
    yield server
    server.stop()


def _complete(served: Served) -> tuple[int, bytes]:
    return _post(f"{served.api}/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}, timeout=120)


START = "==== forge: tritonserver start"


def _again_if_tritonserver_aborted(served: Served, scenario, tries: int = 3):
    """``scenario()``, run again on the restarted server where tritonserver itself died of the kill.

    tritonserver's python backend throws boost's ``lock_exception`` and aborts when a model process dies holding
    a lock of the memory the two share (2 of 30 kills of p_tensorrt_llm's process under this module's load);
    forge serve then restarts tritonserver, which is right but is not the path a scenario checks. Any other
    failure fails at once."""
    for attempt in range(tries):
        since = len(served.stderr)
        try:
            return scenario()
        except AssertionError:
            if attempt + 1 == tries or not _tritonserver_aborted(served, since):
                raise
            served.said("tritonserver is back after", since, timeout=300)
            print(f"tritonserver aborted on the kill (attempt {attempt + 1}); the scenario runs again")


def _tritonserver_aborted(served: Served, since: int) -> bool:
    try:
        served.said("tritonserver was killed by signal 6", since, timeout=10)
    except AssertionError:
        return False
    return True


def _recover(served: Served, kill, what: str, errors: tuple[str, ...] = ("died while serving this request",)) -> None:
    direct = Direct(served)
    streams = Streams(served)
    try:
        streams.wait_streaming()
        assert direct.answered, direct.failures
        since = len(served.stderr)
        killed = kill()
        streams.wait_ended(30)
        assert len(streams.ended) == 3 and all(any(e in how for e in errors) or how == "finished"
                                               for _, how in streams.ended), \
            (streams.ended, "".join(served.stderr[since:])[-3000:])
        failed = [when - killed for when, how in streams.ended if how != "finished"]
        line = served.said("again alone", since)
        assert what in line, line
        reloaded = served.said("is back after", since)
        back = time.monotonic()
        assert _complete(served)[0] == 200 and _status(f"{served.api}/health/ready") == 200, \
            (_complete(served), "".join(served.stderr[since:])[-3000:])
        answered_before = direct.answered
        time.sleep(1.0)
        assert direct.answered > answered_before
        print(f"{what}: the API's streams on it ended {max(failed, default=0):.1f} s after the kill (read slowly); "
              f"it answered again {back - killed:.1f} s after ({reloaded.strip()}); the direct clients answered "
              f"{direct.answered} requests meanwhile")
    finally:
        direct.stop()
        streams.wait_ended(60)
    assert not direct.failures, (f"the model that did not die failed: {direct.failures[:3]}; forge serve said: "
                                 f"{''.join(served.stderr[since:])[-3000:]}")


def test_a_dead_model_process_comes_back_alone_while_the_other_models_serve(served):
    def kill() -> float:
        os.kill(served.stub("p_tensorrt_llm"), signal.SIGKILL)
        return time.monotonic()

    def scenario() -> None:
        engine = served.engine("p_tensorrt_llm")
        starts = served.log.read_text().count(START)
        _recover(served, kill, "killed by signal 9 (SIGKILL)")
        log = served.log.read_text()
        assert log.count(START) == starts, "tritonserver was restarted"
        assert f"took over engine process {engine}," in log and served.engine("p_tensorrt_llm") == engine, \
            [line for line in log.splitlines() if "engine" in line][-5:]

    _again_if_tritonserver_aborted(served, scenario)


def test_a_dead_engine_process_brings_its_model_back_the_same_way(served):
    def kill() -> float:
        os.kill(served.engine("p_tensorrt_llm"), signal.SIGKILL)
        return time.monotonic()

    starts = served.log.read_text().count(START)
    # the model process answers its requests itself, unless the OpenAI API failed them first
    _recover(served, kill, "engine process", ("the engine process exited with status -9",
                                               "died while serving this request"))
    assert served.log.read_text().count(START) == starts, "tritonserver was restarted"


def test_a_request_only_the_dead_process_could_answer_restarts_tritonserver(served):
    """Clients streaming from s_ensemble through Triton itself: tritonserver never answers a request a dead
    decoupled model held, so forge serve restarts it (which closes their connections) instead of a reload."""
    def scenario() -> None:
        first = served.tritonserver()
        starts = served.log.read_text().count(START)
        halt = threading.Event()
        ended: list[str] = []

        def client() -> None:
            while not halt.is_set():
                request = urllib.request.Request(
                    f"{served.http}/v2/models/s_ensemble/generate_stream",
                    data=json.dumps({"text_input": PROMPT, "max_tokens": 100, "bad_words": "", "stop_words": "",
                                     "stream": True}).encode())
                try:
                    with urllib.request.urlopen(request, timeout=60) as response:
                        response.read()
                except Exception as exc:  # noqa: BLE001 - the restart closes the connection
                    ended.append(f"{type(exc).__name__}: {exc}")
                    return

        clients = [threading.Thread(target=client, daemon=True) for _ in range(4)]
        for thread in clients:
            thread.start()
        time.sleep(2.0)
        since = len(served.stderr)
        pid, counted = served.in_flight("s_tensorrt_llm")
        deadline = time.monotonic() + 30  # killed while it holds requests (short ones may all be between steps)
        while (count := InFlight.read(counted) or 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert count >= 2, f"the clients' requests never reached s_tensorrt_llm: {ended}"
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for thread in clients:
            thread.join(30)
        halt.set()
        assert len(ended) == 4, f"{4 - len(ended)} requests hung: {ended}"
        print(f"every direct stream ended within {time.monotonic() - killed:.1f} s of the kill: {ended[0]}")
        line = served.said("only a restart answers them", since)
        assert "s_tensorrt_llm" in line and "request(s) from clients other than the OpenAI API" in line, line
        served.said("tritonserver is back after", since, timeout=300)
        back = time.monotonic()  # tritonserver's models are READY: the API is ready within a second of that
        while _status(f"{served.api}/health/ready") != 200 and time.monotonic() - back < 1.0:
            time.sleep(0.05)
        assert _status(f"{served.api}/health/ready") == 200, "the API's readiness lagged tritonserver's"
        assert served.tritonserver() != first
        assert _complete(served)[0] == 200
        log = served.log.read_text()
        # the crashed generation's lines are kept; a start that failed (a slow machine) and was tried again says why
        retried = [line for line in served.stderr[since:] if "did not start again" in line]
        assert log.count(START) == starts + 1 + len(retried), "".join(served.stderr[since:])[-3000:]
        print("".join(retried))

    _again_if_tritonserver_aborted(served, scenario)


@pytest.mark.parametrize("model", ["p_tensorrt_llm", "p_postprocessing"])
def test_a_drain_after_such_a_reload_does_not_wait_for_the_dead_generation(served, tmp_path, model):
    """``p_postprocessing`` is not decoupled: tritonserver answers its dead process's requests, but the ensemble
    requests around them stay in the ensemble's old generation, which never unloads either."""
    served.stop()  # a server of its own, which no restart came before
    served = Served(served.repo, tmp_path / "triton.log")

    def kill() -> float:
        os.kill(served.stub(model), signal.SIGKILL)
        return time.monotonic()

    try:
        _again_if_tritonserver_aborted(served, lambda: _recover(served, kill, "killed by signal 9 (SIGKILL)"))
    except AssertionError:
        served.stop()
        raise
    since = len(served.stderr)
    started = time.monotonic()
    served.stop()
    took = time.monotonic() - started
    # its last line ("drained and stopped in …" or "the drain was not clean: …; stopped after …"), once read
    last = served.said("stopped", since, timeout=10)
    said = "".join(served.stderr[since:])
    assert served.proc.returncode == 0 and "drained and stopped" in last, said[-3000:]
    # tritonserver waits for that generation (forge ends it), aborts unloading it (its python backend's lock, held
    # by the dead process), or unloads it at once (the requests it held were released before the drain): the drain
    # is clean and short every way, never the exit timeout (30 s of drain + 10 s)
    waited = "waits only for the models whose process died holding requests (p_ensemble" in said
    assert waited or "aborted while it unloaded the models whose process died holding requests" in said \
        or took < 20, said[-3000:]
    print(f"drained in {took:.1f} s: {said.strip().splitlines()[-1]}")
