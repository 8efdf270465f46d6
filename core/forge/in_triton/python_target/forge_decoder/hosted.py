"""The engine in a process of its own (``-o engine_process``), away from the python stub's GIL.

Inside the stub, the engine thread shares one interpreter lock with the stub's request handling and the
threads that build and send responses; each of its torch calls gives the lock away and waits to take it
back. Here the stub keeps what talks to Triton (parsing requests, building and sending responses) and an
``EngineHost`` that stands in for the engine; a child process (``python -m forge_decoder.hosted``) loads the
model and runs the engine. They talk over a socket pair, pickled messages:

* stub → child: ``config`` (once), ``submit`` (a request's rows), ``cancel`` (sequence keys), ``stop``;
* child → stub: ``ready`` or ``failed`` (after loading), ``log``, ``batch`` (every update of one engine step,
  with the engine's counters and its queue's length; a step that changed that length and has no update sends
  one too: a request that does not stream has no update before its last), ``stopped``;
* stub → child: ``ack`` for each batch once its updates are in the stub's sequences. The engine runs at most
  WINDOW batches ahead of the acks. Where the stub's senders cannot send a response per token as fast as the
  engine makes them, each streamed sequence's tokens wait in one pending update that its next response carries
  (``model.py``), so the engine never waits for the senders.

The stub's ``Sequence`` objects stay what ``model.py`` reads: the host copies each update's figures into them
before calling their callback, so responses are built exactly as with the engine in the stub. The child exits
with its parent (``forge_glue.exit_with_parent``); a child that dies fails every sequence it held, and later
requests, with an error naming its exit status.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from . import adoption
from .sequences import Sequence, Update

CANCEL_POLL_S = 0.005  # how often the host looks for sequences the stub cancelled (a stop request, an error)
WINDOW = 2  # batches the engine process may send ahead of the stub's acks
COUNTERS = ("step_ns", "prefill_ns", "decode_steps", "decoded_rows", "admitted", "queued_ns", "prefills", "device_ns",
            "wait_ns", "waiting")  # waiting: a gauge, the engine's queue as of its last step


def python() -> str:
    """The interpreter of this environment: inside a python stub ``sys.executable`` can be the stub itself."""
    names = [sys.executable, os.path.join(sys.exec_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}"),
             os.path.join(sys.exec_prefix, "bin", "python3")]
    for name in names:
        if name and os.path.basename(name).startswith("python") and os.access(name, os.X_OK):
            return name
    raise RuntimeError(f"no python interpreter found for the engine process (tried {', '.join(filter(None, names))})")


class EngineHost:
    """The stub's side: what ``model.py`` calls the engine (``submit``, ``busy``, ``waiting``, the counters,
    ``stop``)."""

    def __init__(self, config: dict, here: Path, *, name: str, info: Callable[[str], None],
                 warn: Callable[[str], None], error: Callable[[str], None], cancel_check_ms: float = 100.0,
                 start_timeout: float = 1800.0):
        self.info, self.warn, self.error = info, warn, error
        self.cancel_check_s = cancel_check_ms / 1000.0
        self.live: dict[int, Sequence] = {}  # key → the stub's sequence, until its last update
        self.keys = itertools.count()
        self.lock = threading.Lock()  # live, and the socket's send side
        self.dead: str | None = None  # why the engine process is gone
        self.stopped = threading.Event()
        self.ended = False
        for counter in COUNTERS:
            setattr(self, counter, 0)
        self.timed = False
        path = adoption.socket_path(name)
        adopted = adoption.adopt(path, config, str(here), name)
        if adopted is not None:  # the engine our model's previous process left loaded (adoption.py)
            self.conn, (self.limits, self.summary, self.graphs, self.timed, pid) = adopted
            self.process = adoption.Adopted(pid)
            info(f"forge python target {name!r}: took over engine process {pid}, which the model's previous "
                 "process left loaded")
        else:
            ours, theirs = socket.socketpair()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here)] + [p for p in sys.path if p]),
                   adoption.SERVER_PID: str(os.getppid())}
            if path is not None:
                env[adoption.SOCKET] = path
            self.process = subprocess.Popen([python(), "-m", "forge_decoder.hosted", str(theirs.fileno()), name],
                                            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
            theirs.close()
            self.conn = Connection(ours.detach())
            self.conn.send(("config", config, str(here), name))
            self._wait_ready(start_timeout)
        self.receiver = threading.Thread(target=self._receive, name="forge-engine-host", daemon=True)
        self.receiver.start()
        self.watcher = threading.Thread(target=self._watch, name="forge-engine-cancels", daemon=True)
        self.watcher.start()

    # -- loading -----------------------------------------------------------------------------------
    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if not self.conn.poll(max(0.0, min(1.0, deadline - time.monotonic()))):
                if self.process.poll() is not None:
                    raise RuntimeError(f"the engine process exited with status {self.process.returncode} while loading")
                if time.monotonic() >= deadline:
                    self._kill()
                    raise RuntimeError(f"the engine process did not load within {timeout:g} s")
                continue
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                status = self.process.wait(timeout=10)
                raise RuntimeError(f"the engine process exited with status {status} while loading") from None
            kind = message[0]
            if kind == "log":
                self._log(*message[1:])
            elif kind == "failed":
                self.process.wait(timeout=30)
                raise RuntimeError(message[1])
            elif kind == "ready":
                self.limits, self.summary, self.graphs, self.timed, _pid = message[1:]
                return

    # -- what model.py calls -------------------------------------------------------------------------
    @property
    def busy(self) -> int:
        return len(self.live)

    def submit(self, sequences: list[Sequence]) -> None:
        """One request's rows to the engine process (together: rows sending one adapter's weights share it)."""
        with self.lock:
            keyed = [(next(self.keys), seq) for seq in sequences]
            if self.dead is None:
                for key, seq in keyed:
                    self.live[key] = seq
                try:
                    self.conn.send(("submit", [(key, seq.request, seq.arrival_ns) for key, seq in keyed]))
                    return
                except (OSError, ValueError):
                    for key, _seq in keyed:
                        self.live.pop(key, None)
                    self.dead = self.dead or "the engine process is gone"
            dead = self.dead
        for _key, seq in keyed:
            seq.on_update(seq, Update([], [], [], True, "error", dead))

    def stop(self, timeout: float = 30.0) -> bool:
        """The engine process stops its engine (failing what it held, reported before this returns) and exits;
        whether it did within ``timeout`` s (else it is killed)."""
        with self.lock:
            try:
                if self.dead is None:
                    self.conn.send(("stop", timeout))
            except (OSError, ValueError):
                pass
        self.stopped.wait(timeout + 2.0)
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._kill()
            return False
        return self.ended

    # -- the threads -----------------------------------------------------------------------------------
    def _receive(self) -> None:
        """Updates from the engine process, each copied into its sequence before its callback."""
        try:
            while True:
                message = self.conn.recv()
                kind = message[0]
                if kind == "batch":
                    self._deliver(message[1], message[2])
                    with self.lock:
                        self.conn.send(("ack",))
                elif kind == "log":
                    self._log(*message[1:])
                elif kind == "stopped":
                    self.ended = message[1]
                    self.dead = "the model is being unloaded"
                    break
        except (EOFError, OSError):
            status = self.process.wait()
            self.dead = f"the engine process exited with status {status}"
            self.error(f"forge decoder: {self.dead}; its requests failed")
        finally:
            with self.lock:
                left = list(self.live.values())
                self.live.clear()
                self.dead = self.dead or "the engine process is gone"
                self.waiting = 0  # nothing queues any more
            for seq in left:
                seq.on_update(seq, Update([], [], [], True, "error", self.dead))
            self.stopped.set()

    def _deliver(self, records: list, counters: dict) -> None:
        for counter, value in counters.items():
            setattr(self, counter, value)
        for key, update, figures in records:
            seq = self.live.get(key)
            if seq is None:
                continue
            if update.finished:
                with self.lock:
                    self.live.pop(key, None)
            seq.__dict__.update(figures)
            if "output" not in figures:  # a streamed update: its tokens follow those before
                seq.output.extend(update.tokens)
                seq.logprobs.extend(update.logprobs)
                seq.generation_logits.extend(update.generation_logits)
                seq.top.extend(update.top)
            seq.finished = update.finished
            try:
                seq.on_update(seq, update)
            except Exception as exc:  # noqa: BLE001 - one owner's failure must not stop everyone's updates
                self.error(f"forge decoder callback failed: {type(exc).__name__}: {exc}")

    def _watch(self) -> None:
        """Sequences cancelled in the stub (a stop request, a failed send) and, every cancel check, those whose
        client went away, to the engine process."""
        told: set[int] = set()
        checked = 0.0
        while not self.stopped.wait(CANCEL_POLL_S):
            ask = time.monotonic() - checked >= self.cancel_check_s
            if ask:
                checked = time.monotonic()
            with self.lock:
                live = list(self.live.items())
            cancel = []
            for key, seq in live:
                if key in told:
                    continue
                if not seq.cancelled and ask:
                    try:
                        seq.cancelled = bool(seq.is_cancelled())
                    except Exception:  # noqa: BLE001 - the owner went away: nobody wants the result
                        seq.cancelled = True
                if seq.cancelled:
                    cancel.append(key)
            told &= {key for key, _seq in live}
            if cancel:
                told.update(cancel)
                with self.lock:
                    try:
                        self.conn.send(("cancel", cancel))
                    except (OSError, ValueError):
                        return

    def _log(self, level: str, message: str) -> None:
        {"info": self.info, "warn": self.warn}.get(level, self.error)(message)

    def _kill(self) -> None:
        try:
            self.process.kill()
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass


class Hosted:
    """The child's side: the engine, fed by the stub's messages, its updates sent back once per step."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.send_lock = threading.Lock()
        self.outbox: list = []
        self.outbox_lock = threading.Lock()
        self.sequences: dict[int, Sequence] = {}
        self.loaded = None
        self.shipped_waiting = 0  # the engine's queue length as the stub last heard it
        self.acks = threading.Condition()
        self.unacked = 0  # batches sent that the stub has not acked
        self.open = True  # False once the stub stops us or is gone: nobody acks any more
        self.listener: socket.socket | None = None  # where the model's next stub finds us (adoption.py)
        self.identity: tuple | None = None  # (config, here) we were loaded with

    def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            try:
                self.conn.send_bytes(data)
            except OSError:
                if self.listener is None:
                    raise
                # the stub is gone: what it held is failed by ``serve``, and the next stub hears nothing of it

    def log(self, level: str, message: str) -> None:
        self.send(("log", level, message))

    def load(self, config: dict, here: Path, name: str) -> None:
        from . import loading

        self.loaded = loading.load_apart(config, here, info=lambda m: self.log("info", m),
                                         warn=lambda m: self.log("warn", m), error=lambda m: self.log("error", m),
                                         name=name)
        self.engine = self.loaded.engine
        self.engine.on_step = self.flush
        self.engine.start()
        self.identity = (config, str(here))
        path = os.environ.get(adoption.SOCKET)
        if path:
            self.listener = adoption.listen(path)
        self.send(("ready", *self.figures()))

    def figures(self) -> tuple:
        """What the stub learns of the loaded engine (``ready``)."""
        return self.loaded.limits, self.loaded.summary, self.loaded.graphs, self.engine.timed, os.getpid()

    def serve(self) -> None:
        """Until ``stop`` or the stub is gone."""
        from .request import RequestError

        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the stub is gone: nobody reads the results
                if self._orphaned():
                    continue
                self.engine.stop(timeout=5.0)
                return
            kind = message[0]
            if kind == "ack":
                with self.acks:
                    self.unacked -= 1
                    self.acks.notify_all()
            elif kind == "submit":
                self._submit(message[1], RequestError)
            elif kind == "cancel":
                for key in message[1]:
                    seq = self.sequences.get(key)
                    if seq is not None:
                        seq.cancel()
            elif kind == "stop":
                self._close()
                ended = self.engine.stop(timeout=message[1])
                self.flush()
                self.send(("stopped", ended))
                return

    def _submit(self, rows: list, request_error: type) -> None:
        try:
            self.loaded.prepare([row for _key, row, _arrival in rows])
        except request_error as exc:
            self._refuse(rows, str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a malformed request: still one clear error
            self._refuse(rows, f"invalid request: {type(exc).__name__}: {exc}")
            return
        sequences = []
        for key, row, arrival_ns in rows:
            seq = Sequence(row, self._report, owner=key)
            seq.arrival_ns = arrival_ns
            self.sequences[key] = seq
            sequences.append(seq)
        self.engine.submit(sequences)

    def _close(self) -> None:
        with self.acks:
            self.open = False
            self.acks.notify_all()

    def _orphaned(self) -> bool:
        """The stub is gone: cancel what it held, then serve the model's next stub if one comes for us (True)."""
        self._close()
        held, self.sequences = list(self.sequences.values()), {}
        for seq in held:
            seq.cancel()
        with self.outbox_lock:
            self.outbox = []
        if self.listener is None:
            return False
        self.log("info", f"forge decoder: engine process {os.getpid()} lost its model process; it cancelled "
                         f"{len(held)} sequence(s) and waits up to {adoption.ADOPT_WAIT_S:g} s for the next one")
        conn = adoption.wait_for_stub(self.listener, self._accept)
        if conn is None:
            return False
        with self.send_lock:
            self.conn = conn
            with self.acks:
                self.unacked, self.open = 0, True
            self.conn.send_bytes(pickle.dumps(("ready", *self.figures()), protocol=pickle.HIGHEST_PROTOCOL))
        return True

    def _accept(self, config: dict, here: str, name: str) -> str | None:
        """Why a stub that asks to take us over may not (None: it may)."""
        if (config, here) != self.identity:
            return f"engine process {os.getpid()} was loaded from another configuration of {name!r}"
        return None

    def _batch(self, records: list, counters: dict, wait: bool) -> None:
        """Send one batch; with ``wait`` (the engine thread) wait until at most WINDOW are not acked."""
        with self.acks:
            self.unacked += 1
        self.send(("batch", records, counters))
        if wait:
            with self.acks:
                while self.unacked > WINDOW and self.open:
                    self.acks.wait(0.1)

    def _refuse(self, rows: list, message: str) -> None:
        self._batch([(key, Update([], [], [], True, "error", message), {}) for key, _row, _a in rows], {}, wait=False)

    def _report(self, seq: Sequence, update: Update) -> None:
        """Engine callback: what the stub's sequence needs of this update (a sequence that does not stream
        sends nothing before its last)."""
        if not (seq.request.streaming or update.finished) or self.sequences.get(seq.owner) is not seq:
            return  # (not ours any more: a sequence of a stub that died)
        figures = {"cum_logprob": seq.cum_logprob, "first_token_ns": seq.first_token_ns,
                   "last_token_ns": seq.last_token_ns, "scheduled_ns": seq.scheduled_ns}
        if update.finished:
            figures.update(output=list(seq.output), logprobs=list(seq.logprobs),
                           generation_logits=list(seq.generation_logits), top=list(seq.top))
            self.sequences.pop(seq.owner, None)
        if seq.context_logits is not None and not getattr(seq, "context_sent", False):
            figures["context_logits"] = seq.context_logits
            seq.context_sent = True
        if seq.prompt_top is not None and not getattr(seq, "prompt_top_sent", False):
            figures["prompt_top"] = seq.prompt_top
            seq.prompt_top_sent = True
        with self.outbox_lock:
            self.outbox.append((seq.owner, update, figures))

    def flush(self) -> None:
        """Engine hook after each step: its updates in one message, with the engine's counters (also without
        updates where its queue's length changed, so that ``waiting`` holds while requests that do not stream
        run)."""
        with self.outbox_lock:
            records, self.outbox = self.outbox, []
        engine = self.engine
        if records or engine.waiting != self.shipped_waiting:
            counters = {c: getattr(engine, c) for c in COUNTERS}
            self.shipped_waiting = counters["waiting"]
            self._batch(records, counters, wait=True)


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    hosted = Hosted(conn)
    kind, config, here, name = conn.recv()
    try:
        import forge_glue

        server = int(os.environ.get(adoption.SERVER_PID) or 0)
        if os.environ.get(adoption.SOCKET) and server > 1:  # outlives its stub (adoption.py), not tritonserver
            forge_glue.exit_with_parent(also=[server], parent=False, what="engine process")
        else:
            forge_glue.exit_with_parent(what="engine process")
        hosted.load(config, Path(here), name)
    except Exception as exc:  # noqa: BLE001 - whatever stops the load: one line for the stub's error
        import traceback

        hosted.log("error", traceback.format_exc())
        hosted.send(("failed", f"the engine process could not load the model: {type(exc).__name__}: {exc}"))
        return
    hosted.serve()
    if hosted.listener is not None:
        with contextlib.suppress(OSError):
            os.unlink(hosted.listener.getsockname())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: an engine thread still inside a step must not hold the exit


if __name__ == "__main__":
    main()
