"""One ``forge serve``: tritonserver, its supervisor and the OpenAI front, kept running and stopped gracefully.

The policy lives here, the command only parses and prints. When a model process dies (``--restart
on-failure``: at most RESTARTS recoveries in RESTART_WINDOW_S, then the session ends with the reason), its
model is loaded again alone while the others serve, unless requests that only the dead process could
answer were left in it (see forge_glue.InFlight) or the load fails: then tritonserver restarts, which
releases them. The OpenAI API fails its own requests on the dead model at once and holds new ones until
it is back. A dead rank of a multi-rank world ends the world and is handled by a restart. SIGTERM or
Ctrl-C drains (no new requests, those in flight finish for up to ``--drain-timeout``) before every
process stops; a second signal stops at once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from typing import Callable

from ..errors import ForgeError, UsageError

RESTARTS, RESTART_WINDOW_S = 5, 600
START_ATTEMPTS = 3  # tries of each restart's start: one can fail under load (a model process slow to come up)
RANK_GRACE_S = 3.0  # a multi-rank world whose model processes died ends within this when a rank died
RANK_ENGINE_GRACE_S = 30.0  # and one whose engine process died (its followers notice, then mpirun ends the world)
RELOAD_DEATH_GRACE_S = 3.0  # a reload that failed because tritonserver is dying (an abort's stack dump): its end


class Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    raise Stop()


class Restarts:
    """``--restart``: whether one more restart is allowed (at most RESTARTS in RESTART_WINDOW_S), and doing it.

    Two things ask: the supervisor when a model process dies, and the session when the server itself ended (a dead
    rank of a multi-rank world: mpirun stops every rank). ``gave_up`` holds the reason once it stops trying.
    """

    def __init__(self, server, policy: str):
        self.server, self.policy = server, policy
        self.times: list[float] = []
        self.gave_up: list[str] = []

    def allowed(self, what: str, doing: str = "restarting") -> bool:
        """Whether one more recovery after ``what`` (one line: what died) is allowed, counting it; False (and
        ``gave_up`` set, which ``Session.run`` raises as the one error line) when the policy says no."""
        now = time.monotonic()
        self.times[:] = [t for t in self.times if now - t < RESTART_WINDOW_S]
        if self.policy == "never" or len(self.times) >= RESTARTS:
            why = "--restart never" if self.policy == "never" else (
                f"{RESTARTS} recoveries within {RESTART_WINDOW_S // 60} minutes already")
            self.gave_up.append(f"{what}; not {doing} ({why})")
            return False
        self.times.append(now)
        return True

    def attempt(self, what: str, counted: bool = False) -> bool:
        """Restart after ``what``; False when the policy says no (``counted``: ``allowed`` already said yes)."""
        now = time.monotonic()
        if not counted and not self.allowed(what):
            return False
        print(f"forge: {what}; restarting tritonserver (requests in flight fail, new ones are served once its "
              "models are READY)", file=sys.stderr, flush=True)

        def again(attempt: int, exc: Exception) -> None:
            print(f"forge: tritonserver did not start again ({exc}); trying again ({attempt + 1} of "
                  f"{START_ATTEMPTS})", file=sys.stderr, flush=True)

        try:
            self.server.restart(1.0, attempts=START_ATTEMPTS, on_retry=again)
        except Exception as exc:  # noqa: BLE001 - reported; server.wait() then returns the failure
            self.gave_up.append(f"tritonserver did not start again after {what}: {exc}")
            print(f"forge: {self.gave_up[-1]}", file=sys.stderr, flush=True)
            return False
        print(f"forge: tritonserver is back after {time.monotonic() - now:.1f} s", file=sys.stderr, flush=True)
        return True


def supervise(server, restarts: Restarts, front: Callable[[], object] = lambda: None):
    """A supervisor of ``server``'s model processes: bring a dead one's model back (while ``restarts`` allows),
    telling the OpenAI API (``front()``, None without one) what is coming back.

    In a multi-rank world a dead rank makes mpirun end every rank, rank 0's model processes with them: when
    the server itself ends within RANK_GRACE_S of their deaths, the session handles that end (naming the rank)."""
    from . import recovery
    from .supervisor import Supervisor

    def on_dead(models: list[str]) -> None:
        line = server.log_line()  # what the dead process and the server said is above this line
        deaths, process = list(supervisor.last_deaths), server.process
        if server.world is not None and server.world.world_size > 1 and process is not None:
            # a dead engine process takes its follower ranks with it, and mpirun then ends the world (seconds later)
            engines = all(pid in supervisor.engine_deaths for pid, _model in deaths)
            try:
                process.wait(RANK_ENGINE_GRACE_S if engines else RANK_GRACE_S)
                return  # the world ended: the session's server.wait() returns and says which rank
            except subprocess.TimeoutExpired:
                pass
        died = supervisor.describe(models)
        print(f"forge: what tritonserver logged before the death ends at line {line} of {server.log_file} "
              "(the log keeps every start's lines)", file=sys.stderr, flush=True)
        api = front()
        failed = 0 if api is None else api.recovering(
            models, f"the process of model {models[0]!r} died while serving this request; it is being brought back: "
                    "retry")
        if failed:
            print(f"forge: the OpenAI API answered its {failed} request(s) in flight on it with 503", file=sys.stderr,
                  flush=True)
        try:
            why = recovery.restart_reason(server, deaths, supervisor.engine_deaths)
            if why is not None:
                if not restarts.attempt(f"{died}; {why}"):
                    server.stop(timeout=5)
                return
            if not restarts.allowed(died, "loading it again"):
                server.stop(timeout=5)
                return
            names = ", ".join(repr(m) for m in models)
            print(f"forge: {died}; loading model {names} again alone (the other models keep serving)",
                  file=sys.stderr, flush=True)
            started, process = time.monotonic(), server.process
            try:
                for model in models:
                    supervisor.retire(model)  # a living model process ends when the new one serves
                    recovery.reload(server, model, held=failed > 0 and any(
                        dead == model and pid not in supervisor.engine_deaths for pid, dead in deaths))
            except ForgeError as exc:
                try:  # its model control answers "Socket closed" before the dying process is gone
                    process.wait(RELOAD_DEATH_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
                if server.process is not process or process.poll() is not None:
                    return  # tritonserver itself ended meanwhile: the session restarts it, once
                if not restarts.attempt(f"{exc}", counted=True):
                    server.stop(timeout=5)
                return
            print(f"forge: model {names} is back after {time.monotonic() - started:.1f} s", file=sys.stderr,
                  flush=True)
        finally:
            if api is not None:
                api.recovered(models)

    supervisor = Supervisor(server, on_dead=on_dead)
    return supervisor


def drain(server, front, supervisor, timeout: float) -> int:
    """Stop gracefully: no new requests, those in flight finish (up to ``timeout`` s), then every process stops.

    The OpenAI API answers new requests 503 (Retry-After) and /health/ready 503 at once; tritonserver
    refuses new HTTP connections (see ``TritonServer.stop_accepting``). When the API's requests (streams
    to their last event) are done and the server's queues empty, or at the deadline, the API stops and
    tritonserver goes on to finish its HTTP requests and unload. 0 after a clean drain, 1 when requests
    were cut.
    """
    started = time.monotonic()
    deadline = started + timeout
    print(f"forge: draining: no new requests; those in flight have up to {timeout:g} s to finish "
          "(a second signal stops at once)", file=sys.stderr, flush=True)
    if supervisor is not None:
        supervisor.stop()
    if front is not None:
        front.front.draining = True  # the API refuses at once, before tritonserver does
    server.stop_accepting()
    left = front.drain(deadline - time.monotonic()) if front is not None else 0
    quiet = 0  # consecutive polls that found the queues empty
    while not left and quiet < 2:
        count = server.in_flight()
        quiet = quiet + 1 if not count else 0
        if time.monotonic() >= deadline:
            left = count or 0
            break
        time.sleep(0.2)
    if front is not None:
        front.stop()
    server.stop(timeout=max(deadline - time.monotonic(), 0.0) + 15)
    status = server.process.returncode if server.process is not None and not server.ended_held else 0
    if status == -signal.SIGABRT and server.held is not None and not left:
        # tritonserver's python backend can abort while it unloads a model generation whose process died holding
        # its lock (boost::interprocess::lock_exception): the requests were done by then
        print("forge: tritonserver aborted while it unloaded the models whose process died holding requests "
              f"({', '.join(sorted(server.held.names))}); every request in flight had finished", file=sys.stderr,
              flush=True)
        status = 0
    if server.world is not None and server.world.world_size > 1:
        status = 0  # mpirun reports the signal that stopped its ranks as status 1: only cut requests count
    took = time.monotonic() - started
    if left or status:
        why = f"{left} request(s) still in flight after --drain-timeout {timeout:g} s" if left else (
            server.exit_message())
        print(f"forge: error: the drain was not clean: {why}; stopped after {took:.1f} s", file=sys.stderr,
              flush=True)
        return 1
    print(f"forge: drained and stopped in {took:.1f} s", file=sys.stderr, flush=True)
    return 0


class Session:
    """``server`` served until a signal or a failure the restart policy gives up on; the OpenAI front beside it
    unless ``openai`` is None (its keyword arguments: host, port, served_model_name, api_key)."""

    def __init__(self, server, *, restart: str, drain_timeout: float, openai: dict | None):
        self.server, self.drain_timeout, self.openai = server, drain_timeout, openai
        self.restarts = Restarts(server, restart)
        self.front = self.supervisor = None

    def run(self, on_ready: Callable[[dict], None]) -> int:
        """Start everything, call ``on_ready`` with the endpoints, serve; the exit status after a drain.

        Raises :class:`ForgeError` (one line, the log named) when the server ended and is not restarted."""
        server = self.server
        previous = signal.signal(signal.SIGTERM, _raise_stop)
        # Ctrl-C and kill -INT drain too, also where forge serve started with SIGINT ignored (a job a script put
        # in the background inherits that, and Python then raises no KeyboardInterrupt: it would live on)
        previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            server.start()
            self.supervisor = supervise(server, self.restarts, lambda: self.front).start()
            on_ready(self._start_front(self._endpoints()))
            while True:
                server.wait()
                if self.restarts.gave_up:
                    raise ForgeError(self.restarts.gave_up[0], hint=f"full log: {server.log_file}")
                # ended by itself, not by a model process the supervisor saw die: a rank of a multi-rank world
                # (mpirun then stops every rank) or tritonserver itself
                if server.stopping or not self.restarts.attempt(server.exit_message()):
                    raise ForgeError(self.restarts.gave_up[0] if self.restarts.gave_up else server.exit_message(),
                                     hint=f"full log: {server.log_file}")
        except (Stop, KeyboardInterrupt):
            if server.process is None or server.process.poll() is not None:
                print("stopping tritonserver", file=sys.stderr)
                return 0
            try:
                return drain(server, self.front, self.supervisor, self.drain_timeout)
            except (Stop, KeyboardInterrupt):
                print("forge: error: stopped at once (a second signal during the drain)", file=sys.stderr,
                      flush=True)
                server.stop(timeout=5)
                return 1
        finally:
            if self.supervisor is not None:
                self.supervisor.stop()
            if self.front is not None:
                self.front.stop()
            server.stop()
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)

    def _endpoints(self) -> dict:
        server = self.server
        models = [m for m in server.models() if m.get("state") == "READY"]
        return {"http": f"http://{server.http_url}", "grpc": server.grpc_url, "metrics": server.metrics_url,
                "log": str(server.log_file), "world_size": server.world.world_size if server.world else 1,
                "models": [m["name"] for m in models]}

    def _start_front(self, info: dict) -> dict:
        if self.openai is None:
            return info
        from ..openai_front import OpenAIServer

        try:
            self.front = OpenAIServer(self.server.repo, self.server.grpc_url, metrics_url=self.server.metrics_url,
                                      **self.openai).start()
        except UsageError as exc:  # nothing it can serve here: Triton's endpoints still are
            print(f"forge: the OpenAI API is off: {exc}", file=sys.stderr, flush=True)
        else:
            info["openai"] = self.front.url
            info["openai_models"] = self.front.catalog.ids()
        return info
