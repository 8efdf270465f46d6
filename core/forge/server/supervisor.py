"""Watch a running tritonserver's python model processes and act when one dies.

tritonserver 2.51 (nvidia-pytriton 0.7) does not bring back a python backend stub that died (a crash,
``kill -9``, the OOM killer): the model stays READY and every later request fails ("Stub process ... is
not healthy"). The requests the dead process held get that error too, except those the model answers
through a response sender (every decoupled model): they never get an answer, even after the model is
loaded again through the model-control API (which serves new requests), and only the end of tritonserver
closes their connections. So a :class:`Supervisor` polls the stubs of a
:class:`~forge.server.triton_server.TritonServer` by pid through /proc, and when one dies it calls
``on_dead`` with the models whose process is gone. The default, :func:`restart_server`, restarts
tritonserver on the same ports; ``forge serve`` (:mod:`.session`) loads the dead model again alone when
no request is stranded in it.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Callable

from .processes import (cmdline, descendants, engine_model, engine_processes, how_it_ended, proc_stat, running,
                        session_processes)
from .triton_server import TritonServer

STUB = "triton_python_backend_stub"
FULL_SCAN_S = 2.0  # how often the supervisor reads the whole process tree (new processes are found then)


def stub_processes(server: TritonServer, pids: list[int] | None = None) -> dict[int, str]:
    """The live python stubs of ``server`` (among ``pids``, default its session): pid → model name."""
    process = server.process
    if process is None or process.poll() is not None:
        return {}
    stubs = {}
    for pid in session_processes(process.pid) if pids is None else pids:
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


def _ended(pid: int, wait: float = 0.3) -> str | None:
    """How ``pid`` ended; a process caught while it exits (its command line already gone) is given ``wait`` s."""
    deadline = time.monotonic() + wait
    while True:
        how = how_it_ended(pid)
        if how is not None or proc_stat(pid) is None or time.monotonic() > deadline:
            return how
        time.sleep(0.01)


class Supervisor:
    """Polls the python stubs of a running ``server``; ``on_dead(models)`` runs when one dies.

    Use ``dead_models()`` to poll by hand, or ``start()`` (a daemon thread every ``interval`` s) /
    the context manager. Stubs ending because the server stops or restarts are not reported.
    """

    def __init__(self, server: TritonServer, on_dead: Callable[[list[str]], None] | None = None,
                 interval: float = 0.2):
        self.server = server
        self.on_dead = on_dead if on_dead is not None else restart_server(server)
        self.interval = interval
        self.deaths: list[tuple[int, str]] = []  # (pid, model) of every death reported
        self.last_deaths: list[tuple[int, str]] = []  # those of the last poll that found any (pid 0: counted short)
        self.causes: dict[int, str | None] = {}  # pid → how it ended ("killed by signal 9 (SIGKILL)"), where known
        self.engine_deaths: set[int] = set()  # the pids among ``deaths`` that were engine processes
        self._engines: dict[int, tuple[str, int]] = {}  # engine process → (its model, its model process)
        self._taken_over: set[int] = set()  # engine processes a model's new stub found loaded (adoption.py)
        self._retired: set[int] = set()  # processes of models being loaded again: they end on purpose
        self._known: dict[int, str] = {}
        self._scanned = -math.inf  # when the last full scan of the process tree ran
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
            self._retired, self._engines, self._taken_over = set(), {}, set()
            if process is None or process.poll() is not None or self.server.stopping:
                return []
        # the whole process tree (every thread's children list, each command line) every FULL_SCAN_S; between
        # those, whether the processes it found still run: a few reads, which keep the GIL from the OpenAI API
        full = not self._complete or time.monotonic() - self._scanned >= FULL_SCAN_S
        if full:
            self._scanned = time.monotonic()
            pids = descendants(process.pid)
            current = {pid: m for pid, m in stub_processes(self.server, pids).items() if pid not in self._retired}
        else:
            current = {pid: model for pid, model in self._known.items() if running(pid)}
        if self.server.stopping or process.poll() is not None:  # stopped while we looked
            self._known = {}
            return []
        dead = [(pid, model) for pid, model in self._known.items() if pid not in current]
        for pid, _model in dead:  # tritonserver reaps a dead stub only later: its exit status is still there
            self.causes[pid] = _ended(pid)
        # an engine process (-o engine_process) whose model process lives on: its model serves nothing more
        engines = self._engine_owners(pids, current) if full else {
            engine: owner for engine, owner in self._engines.items() if running(engine)}
        for engine, (model, stub) in self._engines.items():
            if engine not in engines and stub in current:
                self.causes[engine] = _ended(engine)
                if engine in self._taken_over and self.causes[engine] == "exited with status 0":
                    continue  # one left by a dead stub that the model's next stub did not take: it stopped
                self.engine_deaths.add(engine)
                dead.append((engine, model))
        self._engines = engines
        self._known = current
        # and by count: a model with fewer processes than its instances, once this session had them all (a
        # death between two polls of a process no poll had listed yet, say, is not missed)
        counts = Counter(current.values())
        short = [m for m, n in self._wanted_processes().items() if counts[m] < n] if full else []
        if full and not short:
            self._complete = True
        elif self._complete:
            seen = {model for _pid, model in dead}
            dead += [(0, m) for m in short if m not in seen]
        self.deaths += dead
        if dead:
            self.last_deaths = dead
        return sorted({model for _pid, model in dead})

    def _engine_owners(self, pids: list[int], current: dict[int, str]) -> dict[int, tuple[str, int]]:
        """Engine process → (its model, the model process it serves): its parent, or for an engine that a dead
        stub left under tritonserver (forge_decoder/adoption.py), the model's current stub."""
        stubs = {model: pid for pid, model in current.items()}
        owners = {}
        for engine, parent in engine_processes(pids).items():
            if parent in current:
                owners[engine] = (current[parent], parent)
                continue
            model = engine_model(engine)
            if model in stubs:
                owners[engine] = (model, stubs[model])
                self._taken_over.add(engine)
        return owners

    def describe(self, models: list[str]) -> str:
        """The last deaths in one line: "the process of model 'm' (pid 12, killed by signal 9 (SIGKILL)) died"."""
        ends = [("engine process, " if pid in self.engine_deaths else "") + f"pid {pid}"
                + (f", {self.causes[pid]}" if self.causes.get(pid) else "") for pid, _model in self.last_deaths if pid]
        return (f"the process of model {', '.join(repr(m) for m in models)}" + (f" ({'; '.join(ends)})" if ends else "")
                + " died")

    def retire(self, model: str) -> None:
        """``model`` is being loaded again: its processes of now end on purpose (not reported as deaths)."""
        self._retired |= {pid for pid, m in self._known.items() if m == model}
        self._known = {pid: m for pid, m in self._known.items() if m != model}
        self._engines = {pid: seen for pid, seen in self._engines.items() if seen[0] != model}

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
            try:
                models = self.dead_models()
                if models and not self._halt.is_set():
                    self.on_dead(models)
            except Exception:  # noqa: BLE001 - said, and the next poll goes on: a supervisor never ends silently
                print(f"forge: error: the supervisor's poll failed (it goes on): {traceback.format_exc()}",
                      file=sys.stderr, flush=True)

    def __enter__(self) -> "Supervisor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
