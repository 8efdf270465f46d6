"""Start a real tritonserver on a model repository and wait until every model is READY.

Locally the binary comes from the ``nvidia-pytriton`` wheel (:mod:`.install`); the processes it starts are
found and cleaned up through :mod:`.processes`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import ForgeError, ToolMissingError
from ..in_triton.forge_glue import IN_FLIGHT_DIR
from . import launch
from .install import backend_directory, server_environment, tritonserver_binary
from .processes import free_port, free_ports, kill_session, leftover_processes, spawn


# mpirun's account of the first rank that failed (Open MPI 4): killed by a signal, or a non-zero exit.
_RANK_SIGNAL = re.compile(r"process rank (?P<rank>\d+) with PID \d+ on node \S+ exited on signal "
                          r"(?P<signal>\d+)(?: \((?P<name>[^)]*)\))?")
_RANK_STATUS = re.compile(r"Process name:\s*\[\[\d+,\d+\],(?P<rank>\d+)\]\s*Exit code:\s*(?P<status>\d+)")
# A port someone else bound first: tritonserver says "Socket 'HOST:PORT' already in use", torch's rendezvous
# (the followers of a tensor-parallel python model) "address already in use".
_PORT_TAKEN = re.compile(r"(?:'[^']*:(?P<port>\d+)' )?already in use", re.IGNORECASE)
_PORT_ATTEMPTS = 3
_SERVICE_FAILURE = re.compile(r"failed to start (?P<reason>\w+ service: [^\"\n]*)")
_LOAD_FAILURE = re.compile(r"failed to load '(?P<model>[^']+)' version \d+: (?P<reason>.*)")


def _first_line(reason: str) -> str:
    """A Triton error reason without its traceback (``\\n``-escaped in the log) or status prefix."""
    reason = reason.replace("\\n", "\n").strip().strip('"')
    first = reason.split("\n", 1)[0].strip()
    for prefix in ("Internal: ", "Invalid argument: ", "Unavailable: ", "Not found: "):
        first = first.removeprefix(prefix)
    return first[:500]


def _sigterm_to_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


@dataclass
class TritonServer:
    """A tritonserver process serving ``repo``; use as a context manager.

    Ports of 0 are replaced by free ports. ``start`` returns when every model is READY and raises
    ForgeError with the failing model's own error otherwise.
    """

    repo: Path
    host: str = "127.0.0.1"
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    log_file: Path | None = None
    startup_timeout: float = 300.0
    extra_args: list[str] = field(default_factory=list)
    shm_prefix: str = ""
    world: launch.Layout | None = None  # several ranks: one tritonserver (or follower) per rank under mpirun
    rendezvous_port: int = 0  # where the followers of a tensor-parallel python model meet rank 0 (0: a free port)
    exit_timeout: int = 10  # --exit-timeout-secs: how long a stopped tritonserver waits for requests in flight
    process: subprocess.Popen | None = None
    _stopping: bool = field(default=False, init=False, repr=False)
    _shm_used: str = field(default="", init=False, repr=False)  # the shm-region prefix of the running server
    # generations of models loaded again after their process died holding requests (recovery.Held): tritonserver
    # never unloads them (it waits for answers no process will send), so a stop ends it once only they are left
    held: Any = field(default=None, init=False, repr=False)
    ended_held: bool = field(default=False, init=False, repr=False)
    _restart_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    _restarter: int | None = field(default=None, init=False, repr=False)  # the thread inside ``restart``
    _closing: bool = field(default=False, init=False, repr=False)  # stopped from outside a restart: stay stopped
    _guard: socket.socket | None = field(default=None, init=False, repr=False, compare=False)
    starts: int = field(default=0, init=False)  # how many times a tritonserver was started (restarts included)
    _log_start: int = field(default=0, init=False, repr=False)  # where the running server's lines begin
    in_flight_dir: str = field(default="", init=False, repr=False)  # the model processes' counts (forge_glue.InFlight)

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._client_host}:{self.metrics_port}/metrics"

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host

    def command(self) -> list[str]:
        repo = Path(self.repo).resolve()
        prefix = self.shm_prefix or f"forge{os.getpid()}_{self.http_port}_"
        self._shm_used = prefix
        if self.world is not None and self.world.world_size > 1:
            # Every rank on this machine: no core binding (the ranks share the cores with tritonserver's
            # stubs), more ranks than cores allowed, PATH/LD_LIBRARY_PATH as set here (an absolute mpirun path
            # otherwise puts its prefix's bin/lib first, and the stubs find the system's Python); followers
            # use this interpreter (forge's environment).
            if not self.rendezvous_port:
                self.rendezvous_port = free_port(self._client_host)
            return launch.mpirun_command(
                str(tritonserver_binary()), repo, self.world, host=self.host, http_port=self.http_port,
                grpc_port=self.grpc_port, metrics_port=self.metrics_port, shm_prefix=prefix,
                extra=[f"--backend-directory={backend_directory()}", "--exit-on-error=true",
                       "--strict-readiness=true", f"--exit-timeout-secs={self.exit_timeout}", *self.extra_args],
                mpirun=launch.find_mpirun() or "mpirun", python=sys.executable,
                options=["--oversubscribe", "--bind-to", "none", "--noprefix"],
                rendezvous=(self._client_host, self.rendezvous_port))
        # explicit model control: one model whose process died is loaded again alone (recovery.reload); forge's
        # configs are complete, and completing them starts one more python process per model, importing its code
        control = [] if any(a.startswith("--model-control-mode") for a in self.extra_args) else [
            "--model-control-mode=explicit", "--load-model=*"]
        return [str(tritonserver_binary()), f"--model-repository={repo}", *control, "--disable-auto-complete-config",
                f"--backend-directory={backend_directory()}",
                f"--http-address={self.host}", f"--http-port={self.http_port}",
                f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
                "--allow-metrics=true", "--exit-on-error=true", "--strict-readiness=true",
                f"--exit-timeout-secs={self.exit_timeout}",
                f"--backend-config=python,shm-region-prefix-name={prefix}",
                *self.extra_args]

    def start(self) -> "TritonServer":
        if not Path(self.repo).is_dir():
            raise ForgeError(f"model repository {self.repo} is not a directory")
        binary = tritonserver_binary()
        if not binary.is_file():
            raise ToolMissingError(f"tritonserver binary not found at {binary}")
        left = leftover_processes(Path(self.repo))
        if left:
            pids = " ".join(str(pid) for pid in left)
            raise ForgeError(f"processes of an earlier server of {self.repo} still run (pids {pids}) and hold its "
                             "memory", hint=f"end them first: kill -9 {pids}")
        if self.world is not None and self.world.world_size > 1 and launch.find_mpirun() is None:
            import shlex

            raise ToolMissingError(
                f"this repository needs {self.world.world_size} ranks, and mpirun is not installed",
                hint=f"install Open MPI, or run on a machine that has it: {shlex.join(self.command())}")
        # Ports of 0 are picked here; another process may bind one between the pick and the server's
        # bind, so a server that stops on a taken port it did not ask for starts again on fresh ones.
        chosen = [name for name in ("http_port", "grpc_port", "metrics_port", "rendezvous_port")
                  if not getattr(self, name)]
        attempts = _PORT_ATTEMPTS
        while True:
            picked = iter(free_ports(len(chosen), self._client_host))
            for name in chosen:
                port = next(picked)
                setattr(self, name, 0 if name == "rendezvous_port" else port)
            attempts -= 1
            try:
                return self._launch()
            except ForgeError:
                if not attempts or not self._took_a_chosen_port(chosen):
                    raise

    def _launch(self) -> "TritonServer":
        self._trap_sigterm()
        if self.log_file is None:
            handle, name = tempfile.mkstemp(prefix="forge-tritonserver-", suffix=".log")
            os.close(handle)
            self.log_file = Path(name)
        self.log_file = Path(self.log_file)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        # Appended, each start under a header line: a restart keeps the lines that explain why it was needed.
        log = open(self.log_file, "a")
        self.starts += 1
        self.held, self.ended_held = None, False
        self._log_start = log.tell()
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        log.write(f"==== forge: tritonserver start {self.starts} at {stamp} UTC, repository {self.repo} ====\n")
        log.flush()
        # tritonserver dies with forge (SIGKILL: its stubs then exit on their own, see forge_glue); mpirun
        # gets SIGTERM, which it passes on to every rank before it exits.
        several = self.world is not None and self.world.world_size > 1
        self._stopping = False
        env = server_environment()
        self.in_flight_dir = tempfile.mkdtemp(prefix="forge-inflight-",
                                               dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
        env[IN_FLIGHT_DIR] = self.in_flight_dir
        if several:  # an engine process outlives its stub for the model's next one only where one rank reloads
            env["FORGE_ENGINE_ADOPTION"] = "0"
        self.process = spawn(self.command(), signal.SIGTERM if several else signal.SIGKILL, stdout=log,
                              stderr=subprocess.STDOUT, env=env, start_new_session=True, subreaper=not several)
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _took_a_chosen_port(self, chosen: list[str]) -> bool:
        """Whether the server's log says it stopped on a taken port that was picked here (not one asked for)."""
        try:
            text = self.log_text()
        except OSError:
            return False
        matches = list(_PORT_TAKEN.finditer(text))
        named = {int(match["port"]) for match in matches if match["port"]}
        if named:
            return bool(named & {getattr(self, name) for name in chosen})
        # no port named: torch's rendezvous, which only the followers of a multi-rank server use
        return bool(matches) and "rendezvous_port" in chosen and self.world is not None and self.world.world_size > 1

    def log_text(self) -> str:
        """The running (or last) server's log lines: from its start header on."""
        try:
            with open(self.log_file, "rb") as log:
                log.seek(self._log_start)
                return log.read().decode(errors="replace")
        except (OSError, TypeError):
            return ""

    def log_line(self) -> int:
        """How many lines the log holds now (where the next line will be)."""
        try:
            with open(self.log_file, "rb") as log:
                return sum(chunk.count(b"\n") for chunk in iter(lambda: log.read(1 << 20), b""))
        except (OSError, TypeError):
            return 0

    def request(self, path: str, method: str = "GET", body: bytes | None = None,
                timeout: float = 5.0) -> tuple[int, bytes]:
        """One HTTP request to the server: (status, body); an HTTP error status is returned, not raised."""
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=body, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def models(self) -> list[dict]:
        """The repository index: name, version, state and reason of every model."""
        status, body = self.request("/v2/repository/index", "POST", b"{}")
        return json.loads(body) if status == 200 else []

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ForgeError(self.exit_message(), hint=f"full log: {self.log_file}")
            try:
                status, _ = self.request("/v2/health/ready")
            except (urllib.error.URLError, ConnectionError, OSError):
                status = 0
            if status == 200:
                return
            time.sleep(0.25)
        raise ForgeError(f"tritonserver did not become ready within {self.startup_timeout:.0f}s: "
                         f"{self.failure()}", hint=f"full log: {self.log_file}")

    def exit_message(self) -> str:
        """One line on why the server (or, with several ranks, which rank) stopped."""
        status = self.process.returncode if self.process is not None else None
        ranks = self.rank_failure() if self.world is not None and self.world.world_size > 1 else None
        reason = self.failure()
        if ranks:
            return f"{ranks} (mpirun exit status {status})" + (
                f"; tritonserver: {reason}" if _LOAD_FAILURE.search(reason) or reason.startswith("model ") else "")
        launcher = "mpirun" if self.world is not None and self.world.world_size > 1 else "tritonserver"
        if status is not None and status < 0:
            return f"{launcher} was killed by signal {-status}: {reason}"
        return f"{launcher} exited with status {status}: {reason}"

    def wait(self) -> int:
        """Block until the server exits (not counting a ``restart``); its exit status."""
        while True:
            process = self.process
            status = process.wait() if process is not None else 0
            with self._restart_lock:  # a restart in progress holds it until the new process runs
                if self.process is process:
                    return status

    @property
    def stopping(self) -> bool:
        """Whether ``stop`` was called on the running server (its stubs then end on purpose)."""
        return self._stopping

    def restart(self, timeout: float = 10.0, attempts: int = 1,
                on_retry: Callable[[int, Exception], None] | None = None) -> "TritonServer":
        """Stop the server (SIGINT, then SIGKILL after ``timeout``) and start it again on the same ports.

        Clients with requests in flight see their connections close, which is how they learn of a
        model process that died (Triton 2.51 never answers them, see supervisor.py). ``wait`` keeps
        waiting across it. A start that fails (a model process that does not come up under load, say) is
        tried again up to ``attempts`` times in all, ``on_retry(attempt, error)`` before each new try,
        unless the server is stopped from elsewhere meanwhile; the last failure is raised.
        """
        with self._restart_lock:
            if self._stopping:  # stopped meanwhile (forge serve is exiting): stay stopped
                return self
            self._restarter, self._closing = threading.get_ident(), False
            try:
                for attempt in range(1, attempts + 1):
                    self.stop(timeout)
                    try:
                        return self._launch()
                    except ForgeError as exc:
                        if attempt == attempts or self._closing:
                            raise
                        if on_retry is not None:
                            on_retry(attempt, exc)
                        time.sleep(min(2.0 * attempt, 10.0))
                        if self._closing:
                            raise
                return self
            finally:
                self._restarter = None

    def rank_failure(self) -> str | None:
        """Which rank ended a multi-rank server, as mpirun reported it (None: no rank failed)."""
        text = self.log_text()
        match = _RANK_SIGNAL.search(text) or _RANK_STATUS.search(text)
        if match is None:
            return None
        rank = int(match["rank"])
        what = "tritonserver" if rank == 0 or self.world is None or self.world.follower_dir is None else (
            f"the follower of model {self.world.follower_model!r}")
        how = (f"exited on signal {match['signal']}" + (f" ({match['name']})" if match["name"] else "")
               if "signal" in match.groupdict() else f"exited with status {match['status']}")
        return f"rank {rank} ({what}) {how}; mpirun stopped every rank"

    def failure(self) -> str:
        """The most specific error the server reported (a model's load failure if there is one)."""
        try:
            for model in self.models():
                if model.get("state") == "UNAVAILABLE" and model.get("reason"):
                    return f"model {model['name']!r}: {_first_line(model['reason'])}"
        except (OSError, ValueError):
            pass
        text = self.log_text()
        service = _SERVICE_FAILURE.search(text)
        if service:
            return f"failed to start its {service['reason'].strip()}"
        for line in text.splitlines():
            match = _LOAD_FAILURE.search(line)
            if match:
                return f"model {match['model']!r}: {_first_line(match['reason'])}"
        for line in text.splitlines():
            if "CudaDriverHelper has not been initialized" in line:
                continue  # every CPU-only start logs it
            if line[:1] == "E" or "error" in line.lower():
                return _first_line(line.split("] ", 1)[-1])
        lines = [l for l in text.splitlines() if l.strip()]
        return lines[-1][:500] if lines else "no output"

    def stop_accepting(self) -> bool:
        """Begin a graceful stop: new HTTP connections are refused, requests in flight go on (one rank only).

        tritonserver 2.51 on SIGINT first closes its HTTP listener and waits (up to --exit-timeout-secs)
        for its open HTTP connections to end while serving everything (gRPC keeps taking new requests);
        then it stops every model's scheduler, which refuses the next step of an ensemble in flight ("Server
        is stopping, scheduler for model has stopped accepting new inference requests": a decoupled
        stream stalls until the exit timeout). One HTTP connection held open here keeps it in the first
        phase until ``stop`` closes it (after the OpenAI API's requests finished): HTTP requests in flight
        finish, gRPC requests sent straight to Triton may not. Several ranks: mpirun ends the ranks on a
        signal, so nothing is done here (``stop`` still signals it).
        """
        if self.process is None or self.process.poll() is not None or self._guard is not None or (
                self.world is not None and self.world.world_size > 1):
            return False
        self._stopping = True
        try:  # a request answered on it: tritonserver has accepted (and counts) the connection
            guard = socket.create_connection((self._client_host, self.http_port), timeout=5)
            guard.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: forge\r\n\r\n")
            guard.recv(4096)
        except OSError:
            return False
        self._guard = guard
        self.process.send_signal(signal.SIGINT)
        return True

    def in_flight(self) -> int | None:
        """Requests waiting in the server's queues and forge decoders' (None: unknown), as the OpenAI API's
        ``vllm:num_requests_waiting`` counts them for every model.

        Not the generations running (forge decoders' ``forge_decoder_sequences`` gauge): the drain waits for
        the OpenAI API's requests itself, and Triton clients' requests keep their HTTP connections open.
        """
        from ..openai_front.scheduler_stats import figures

        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as response:
                return int(figures(response.read().decode(errors="replace"), None).waiting)
        except (OSError, ValueError):
            return None

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and every process it started (python stubs, MPI ranks)."""
        if self._restarter is not None and self._restarter != threading.get_ident():
            self._closing = True  # a restart on another thread tries no further start
        try:
            if self.process is None:
                return
            self._stopping = True
            signalled = self._guard is not None  # by stop_accepting: closing the guard lets it go on to unload
            if signalled:
                self._guard.close()
                self._guard = None
            if self.process.poll() is None:
                # Signal the server alone: it unloads models and stops its stubs itself; signalling
                # the whole group first kills the stubs under it and leaves the server waiting.
                if not signalled:
                    self.process.send_signal(signal.SIGINT)
                if not self._exited(timeout):
                    os.killpg(self.process.pid, signal.SIGKILL)
                    self.process.wait()
            try:  # stubs may outlive the server by a moment; they are in its process group
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            # MPI ranks have process groups of their own and outlive a killed mpirun; they stay in its session.
            kill_session(self.process.pid)
            self._remove_shm()
            if self.in_flight_dir:
                import shutil

                shutil.rmtree(self.in_flight_dir, ignore_errors=True)
                self.in_flight_dir = ""
        finally:
            if getattr(self, "_restore_sigterm", False) and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                self._restore_sigterm = False

    def _exited(self, timeout: float) -> bool:
        """Whether the stopping server exits within ``timeout``; False at once when the models it still waits for
        to unload are only the ``held`` generations (tritonserver logs its count each second)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.process.wait(min(0.5, max(deadline - time.monotonic(), 0.0)) if self.held is not None else timeout)
                return True
            except subprocess.TimeoutExpired:
                if self.held is not None and self.held.only_left(self.log_text()):
                    print("forge: tritonserver waits only for the models whose process died holding requests "
                          f"({', '.join(sorted(self.held.names))}; it never unloads them): ended it",
                          file=sys.stderr, flush=True)
                    self.ended_held = True
                    return False
                if time.monotonic() >= deadline:
                    return False

    def _remove_shm(self) -> None:
        """Remove the stubs' shared-memory regions a server killed outright leaves in /dev/shm."""
        prefix = self._shm_used
        if not prefix or "/" in prefix:
            return
        for region in Path("/dev/shm").glob(f"{prefix}*"):
            try:
                region.unlink()
            except OSError:
                pass

    def _trap_sigterm(self) -> None:
        """Turn SIGTERM into KeyboardInterrupt while the server runs, so ``stop`` still runs.

        The server lives in its own session (Ctrl-C in a terminal reaches only forge), so a forge
        process killed without cleanup would leave it running.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
            self._restore_sigterm = True

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
