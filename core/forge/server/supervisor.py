"""Watch a running tritonserver's python model processes and act when one dies.

tritonserver 2.51 (nvidia-pytriton 0.7) does not notice that a python backend stub died (a crash,
``kill -9``, the OOM killer): the model stays READY, requests in flight on it never get an answer, and
only requests sent afterwards fail ("Stub process ... is not healthy"). Unloading the model through the
model-control API (``--model-control-mode=explicit``) answers no pending request either; loading it
again serves new requests, but the old ones still hang. Only the end of tritonserver closes their
connections. So a :class:`Supervisor` polls the stubs of a :class:`~forge.server.triton_server.TritonServer`
by pid through /proc, and when one dies it calls ``on_dead`` with the models whose process is gone;
the default, :func:`restart_server`, restarts tritonserver on the same ports: every request in flight
gets a connection error at once, and requests are served again once the models are READY.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Callable

from .processes import cmdline, proc_stat, session_processes
from .triton_server import TritonServer

STUB = "triton_python_backend_stub"


def stub_processes(server: TritonServer) -> dict[int, str]:
    """The live python stubs of ``server`` (its session): pid → model name."""
    process = server.process
    if process is None or process.poll() is not None:
        return {}
    stubs = {}
    for pid in session_processes(process.pid):
        args = cmdline(pid)
        stat = proc_stat(pid)
        if len(args) > 1 and Path(args[0]).name == STUB and stat is not None:
            stubs[pid] = Path(args[1]).parent.parent.name  # <repo>/<model>/<version>/model.py
    return stubs


def restart_server(server: TritonServer, grace: float = 1.0,
                   log: Callable[[str], None] | None = None) -> Callable[[list[str]], None]:
    """An ``on_dead`` action: restart ``server`` (SIGKILL after ``grace`` s: its pending requests cannot finish)."""
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))

    def act(models: list[str]) -> None:
        say(f"forge: the process of model {', '.join(repr(m) for m in models)} died; restarting tritonserver "
            "(requests in flight fail, new ones are served once its models are READY)")
        try:
            server.restart(grace)
        except Exception as exc:  # noqa: BLE001 - reported; server.wait() then returns the failure
            say(f"forge: tritonserver did not start again: {exc}")

    return act


class Supervisor:
    """Polls the python stubs of a running ``server``; ``on_dead(models)`` runs when one dies.

    Use ``dead_models()`` to poll by hand, or ``start()`` (a daemon thread every ``interval`` s) /
    the context manager. Stubs ending because the server stops or restarts are not reported.
    """

    def __init__(self, server: TritonServer, on_dead: Callable[[list[str]], None] | None = None,
                 interval: float = 0.5):
        self.server = server
        self.on_dead = on_dead if on_dead is not None else restart_server(server)
        self.interval = interval
        self.deaths: list[tuple[int, str]] = []  # (pid, model) of every death reported
        self.last_deaths: list[tuple[int, str]] = []  # those of the last poll that found any (pid 0: counted short)
        self._known: dict[int, str] = {}
        self._session: int | None = None
        self._wanted: dict[str, int] | None = None  # python model → its processes (the repository's configs)
        self._complete = False  # this session has had every wanted process at once
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def dead_models(self) -> list[str]:
        """The models whose stub died since the last call (sorted, each once)."""
        process = self.server.process
        session = None if process is None else process.pid
        if process is None or process.poll() is not None or self.server.stopping or session != self._session:
            self._known, self._session, self._complete = {}, session, False  # stopped, exited or restarted
            if process is None or process.poll() is not None or self.server.stopping:
                return []
        current = stub_processes(self.server)
        if self.server.stopping or process.poll() is not None:  # stopped while we looked
            self._known = {}
            return []
        dead = [(pid, model) for pid, model in self._known.items() if pid not in current]
        self._known = current
        # and by count: a model with fewer processes than its instances, once this session had them all (a
        # death between two polls of a process no poll had listed yet, say, is not missed)
        counts = Counter(current.values())
        short = [m for m, n in self._wanted_processes().items() if counts[m] < n]
        if not short:
            self._complete = True
        elif self._complete:
            seen = {model for _pid, model in dead}
            dead += [(0, m) for m in short if m not in seen]
        self.deaths += dead
        if dead:
            self.last_deaths = dead
        return sorted({model for _pid, model in dead})

    def watching(self) -> dict[int, str]:
        """The processes the last poll saw: pid → model."""
        return dict(self._known)

    def _wanted_processes(self) -> dict[str, int]:
        if self._wanted is None:
            from .launch import python_processes

            try:
                self._wanted = python_processes(Path(self.server.repo))
            except Exception:  # noqa: BLE001 - unreadable configs: the pids alone tell deaths
                self._wanted = {}
        return self._wanted

    def start(self) -> "Supervisor":
        self._halt.clear()
        self._thread = threading.Thread(target=self._run, name="forge-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._halt.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._halt.wait(self.interval):
            models = self.dead_models()
            if models and not self._halt.is_set():
                self.on_dead(models)

    def __enter__(self) -> "Supervisor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
