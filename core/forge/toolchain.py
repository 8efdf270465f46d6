"""External toolchains (trtllm-build, trtexec, tritonserver): discovery, versions, recorded runs."""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import ForgeError, ToolMissingError


@dataclass(frozen=True)
class Tool:
    name: str
    enables: str
    version_args: tuple[str, ...] = ("--version",)


TOOLS = (
    Tool("trtllm-build", "--target tensorrtllm (TensorRT-LLM engines for gpt, llama)"),
    Tool("trtexec", "--target tensorrt (TensorRT plans for clip, minilm)", ("--help",)),
    Tool("tritonserver", "forge serve without the nvidia-pytriton wheel"),
    Tool("mpirun", "forge serve of repositories built for several ranks (--tp; tensorrtllm or python target)"),
)


def which(name: str) -> str | None:
    return shutil.which(name)


def identity(name: str) -> str:
    """A cheap fingerprint of an installed tool (path and mtime), or "absent"."""
    path = which(name)
    if not path:
        return "absent"
    st = os.stat(path)
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def version(name: str, args: tuple[str, ...] = ("--version",), timeout: float = 20) -> str | None:
    """The first line a tool prints about its version, or None when it is absent."""
    path = which(name)
    if not path:
        return None
    import subprocess  # here, not at the top: every command imports this module, few run a tool

    try:
        proc = subprocess.run([path, *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"present ({path}), version unknown: {exc}"
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.strip():
            return line.strip()[:200]
    return f"present ({path})"


def run(argv: list[str], *, purpose: str, cwd: Path | None = None, log: Path | None = None,
        env: dict[str, str] | None = None) -> None:
    """Run an external tool; a missing tool or a failure becomes one clear ForgeError."""
    if which(argv[0]) is None:
        raise ToolMissingError(
            f"{argv[0]} is not installed; {purpose} needs it",
            hint=f"use --target python to run on this machine, or run the recorded command on a "
                 f"machine with the toolchain: {shlex.join(argv)}")
    import subprocess

    with open(log or os.devnull, "w") as out:
        proc = subprocess.run(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                              env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        tail = ""
        if log and log.exists():
            lines = log.read_text(errors="replace").splitlines()
            tail = f"; last output: {lines[-1][:300]}" if lines else ""
        raise ForgeError(f"{argv[0]} exited with status {proc.returncode}{tail}",
                         hint=f"full log: {log}" if log else None)
