"""The processes of a served repository, read from Linux ``/proc``, and children that die with forge.

What ``forge serve`` starts (tritonserver, mpirun, ranks, python stubs, engine processes) is found by
what it serves from, so a stopped server can prove it left nothing behind and a new one can clean up
after a killed forge.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path


def session_processes(sid: int) -> list[int]:
    """Processes of session ``sid`` (Linux /proc), other than this one."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session …
        if len(fields) > 3 and fields[3] == str(sid) and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def descendants(pid: int) -> list[int]:
    """The living processes under ``pid`` (children, theirs, …) through /proc's children lists: a few reads
    where ``session_processes`` reads every process of the machine. A kernel without the lists: the session's."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = list(Path(f"/proc/{parent}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                children = (task / "children").read_text().split()
            except FileNotFoundError:
                return session_processes(pid) if parent == pid else found
            except OSError:
                continue
            for child in map(int, children):
                found.append(child)
                todo.append(child)
    return found


def kill_session(sid: int) -> None:
    """SIGKILL whatever is left of session ``sid`` (the server was started as its leader)."""
    for pid in session_processes(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


_spawner = None  # the one thread that starts servers for other threads (see _spawn)


_spawner_lock = threading.Lock()


def _die_with_parent(sig: int, parent: int, subreaper: bool = False):
    """A ``preexec_fn``: the child gets ``sig`` when forge dies (Linux ``PR_SET_PDEATHSIG``); with ``subreaper``
    the processes orphaned under it become its children (``PR_SET_CHILD_SUBREAPER``, kept across exec), not
    init's: an engine process whose python stub died stays in tritonserver's tree.

    The kernel sends it when the *thread* that forked the child exits, not the process; ``_spawn``
    therefore forks only on the main thread or on a thread that lives as long as forge.
    """
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    except (OSError, AttributeError):  # not Linux: no parent-death signal (stop() still ends the server)
        return None

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if subreaper:
            prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        if os.getppid() != parent:  # forge died before the signal was armed
            os._exit(1)

    return arm


def spawn(argv: list[str], sig: int, subreaper: bool = False, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` whose child dies with forge: forked on the main thread or on a lasting spawner thread."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(argv, preexec_fn=_die_with_parent(sig, os.getpid(), subreaper), **kwargs)
    with _spawner_lock:
        if _spawner is None:
            from concurrent.futures import ThreadPoolExecutor

            _spawner = ThreadPoolExecutor(1, thread_name_prefix="forge-spawn")  # its thread stays until forge exits
    return _spawner.submit(
        lambda: subprocess.Popen(argv, preexec_fn=_die_with_parent(sig, os.getpid(), subreaper), **kwargs)).result()


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(comm, ppid, session) of ``pid``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return text[text.find("(") + 1:text.rfind(")")], int(fields[1]), int(fields[3])


def running(pid: int) -> bool:
    """Whether ``pid`` runs: not ended, not a zombie (one read, where ``how_it_ended`` tells how)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2:][:1] not in ("Z", "X", "x")


def how_it_ended(pid: int) -> str | None:
    """How a process that ended but is not yet reaped (a zombie) ended: "killed by signal 9 (SIGKILL)",
    "exited with status 1"; None when it is not a zombie (still running, or already reaped)."""
    import signal

    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    if not fields or fields[0] != "Z" or len(fields) < 50:
        return None
    status = int(fields[-1])  # exit_code: the wait status (Linux 3.5+)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            name = f" ({signal.Signals(number).name})"
        except ValueError:
            name = ""
        return f"killed by signal {number}{name}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def _refers_to(pid: int, repo: str) -> bool:
    """Whether process ``pid`` serves from ``repo``: its command line, working directory or PYTHONPATH name it."""
    args = cmdline(pid)
    if any(arg == repo or arg.startswith(repo + os.sep) or arg.endswith("=" + repo) for arg in args):
        return True
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
        if cwd == repo or cwd.startswith(repo + os.sep):  # not a sibling whose name starts alike (repo-2)
            return True
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    paths = next((e[len(b"PYTHONPATH="):].decode(errors="replace") for e in environ if e.startswith(b"PYTHONPATH=")), "")
    return any(p == repo or p.startswith(repo + os.sep) for p in paths.split(os.pathsep))


def _ancestors() -> set[int]:
    """This process and its ancestors."""
    found, pid = set(), os.getpid()
    while pid > 0 and pid not in found:
        found.add(pid)
        stat = proc_stat(pid)
        pid = stat[1] if stat is not None else 0
    return found


def repository_processes(repo: Path) -> list[int]:
    """Live processes serving from ``repo`` (Linux /proc): tritonserver, mpirun, ranks, python stubs, followers.

    What a stopped server must not leave behind; zombies (ended, not yet reaped) hold nothing and are not listed.
    """
    root = str(Path(repo).resolve())
    found = []
    mine = _ancestors()  # this process and what started it (timeout, nohup, a shell in the repository) serve nothing
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        pid = int(entry.name)
        if _state(pid) not in (None, "Z") and _refers_to(pid, root):
            found.append(pid)
    return sorted(found)


def describe_process(pid: int) -> str:
    """``PID: command line`` (cut at 120 characters), for messages about processes left behind."""
    return f"{pid}: {' '.join(cmdline(pid))[:120]}"


def python_stubs(pids: "list[int]") -> dict[str, int]:
    """The python-backend model processes among ``pids``: model name → pid (``<repo>/<model>/<version>/model.py``)."""
    found = {}
    for pid in pids:
        args = cmdline(pid)
        if len(args) > 1 and os.path.basename(args[0]) == "triton_python_backend_stub":
            found[Path(args[1]).parent.parent.name] = pid
    return found


def engine_processes(pids: "list[int]") -> dict[int, int]:
    """The python target's engine processes among ``pids`` (``-o engine_process``): engine pid → its parent's pid
    (its stub's, or tritonserver's for one whose stub died: see forge_decoder/adoption.py)."""
    found = {}
    for pid in pids:
        stat = proc_stat(pid)
        if stat is not None and "forge_decoder.hosted" in cmdline(pid):
            found[pid] = stat[1]
    return found


def engine_model(pid: int) -> str | None:
    """The model an engine process serves (``python -m forge_decoder.hosted FD MODEL``)."""
    args = cmdline(pid)
    return args[4] if len(args) > 4 and args[2] == "forge_decoder.hosted" else None


def _state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:][:1]


def leftover_processes(repo: Path) -> list[int]:
    """Processes left by an earlier server of ``repo`` whose owner is gone (Linux /proc).

    A python stub whose tritonserver is gone (re-parented), or a tritonserver, mpirun or follower
    re-parented to init (the forge that started it was killed). Servers whose parent still runs
    (another ``forge serve`` of the same repository) are not leftovers.
    """
    found = []
    for pid in repository_processes(repo):
        stat = proc_stat(pid)
        if stat is None:
            continue
        args = cmdline(pid)
        stub = bool(args) and os.path.basename(args[0]) == "triton_python_backend_stub"
        parent = proc_stat(stat[1]) if stat[1] > 1 else None
        if (stub and (parent is None or parent[0] != "tritonserver")) or (not stub and stat[1] == 1):
            found.append(pid)
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` different free ports (two picks in a row can return the same port once it is released)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports
