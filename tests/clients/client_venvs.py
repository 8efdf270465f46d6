"""Virtualenvs of the pinned third-party clients, one per tool (their dependencies conflict with forge's and with
each other's), made once under the forge cache and reused while their marker says the same spec was installed;
and a client run as its console script from its venv, with a timeout and its output kept in a log file.

    python tests/clients/client_venvs.py    # make them all ahead of a test run
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

#: venv name → the pip requirement installed into it
CLIENTS = {
    "lm-eval-0.4.13": "lm-eval[api]==0.4.13",
    "aiperf-0.13.0": "aiperf==0.13.0",
}
MARKER = "forge-client.json"  # written last: a venv without it is incomplete and made again
INSTALL_TIMEOUT_S = 1800  # aiperf pulls ~150 wheels; a cold pip cache on a slow link takes minutes


def clients_dir() -> Path:
    """``clients`` in the forge cache (``$FORGE_CACHE_DIR`` or the user cache directory)."""
    from forge.cache import cache_dir

    return cache_dir() / "clients"


def _stamp(spec: str) -> dict:
    return {"spec": spec, "python": sys.version.split()[0]}


def client_venv(name: str, root: Path | None = None) -> Path:
    """The venv ``name`` of ``CLIENTS`` with its spec installed: made (pip install) unless already complete."""
    from filelock import FileLock

    spec = CLIENTS[name]
    venv = (root or clients_dir()) / name
    marker = venv / MARKER

    def ready() -> bool:
        try:
            return json.loads(marker.read_text()) == _stamp(spec)
        except (OSError, ValueError):
            return False

    if ready():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(venv) + ".lock"):
        if ready():  # another process finished it while we waited
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        # the interpreter of the tests (a venv's python makes a venv of its base interpreter, same version)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run([*pip, spec], check=True, timeout=INSTALL_TIMEOUT_S)
        marker.write_text(json.dumps(_stamp(spec)))
    return venv


def run_client(venv: Path, script: str, args: list[str], *, log: Path, timeout: float, cwd: Path | None = None,
               env: dict[str, str] | None = None) -> int:
    """Run ``venv``'s console script with ``args``; stdout and stderr go to ``log``. The exit status (-9: timed out).

    The client runs in a session of its own, so a timeout ends the processes it started too (aiperf runs its
    workers and record processors as processes of their own)."""
    command = [str(venv / "bin" / script), *args]
    with open(log, "w") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                   start_new_session=True)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            out.write(f"\n(killed after {timeout:.0f} s)\n")
            return -9


def tail(log: Path, lines: int = 40) -> str:
    """The last lines of a client's log, for a failure message."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    for client in CLIENTS:
        print(client_venv(client))
