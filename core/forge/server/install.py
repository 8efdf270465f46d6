"""The local tritonserver: the binary and python backend of the ``nvidia-pytriton`` wheel, arranged to run.

Its python backend needs three things arranged (see DESIGN.md): a backend directory holding the python
stub for this interpreter's version, this virtualenv's ``bin`` first on ``PATH`` (the stub finds its
Python that way), and this interpreter's libpython first on ``LD_LIBRARY_PATH`` (the stub links it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from ..cache import cache_dir
from ..errors import ToolMissingError


def pytriton_root() -> Path:
    """The ``pytriton`` package directory (found without importing pytriton)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ToolMissingError("tritonserver is not available: the nvidia-pytriton package is not installed",
                               hint="pip install nvidia-pytriton (or forge[serve])")
    return Path(list(spec.submodule_search_locations)[0])


def check_stub_numpy() -> None:
    """tritonserver 2.51's python stub (nvidia-pytriton 0.7) misreads every array under numpy 2.

    The stub runs this interpreter (this environment's ``bin`` is first on its PATH), so the numpy
    here is the one it gets; forge's own install pins numpy < 2, an environment that overrode it is
    refused instead of serving models that crash on their first request.
    """
    import numpy

    if int(numpy.__version__.split(".")[0]) >= 2:
        raise ToolMissingError(
            f"this environment has numpy {numpy.__version__}; the python backend stub of the bundled tritonserver "
            "misreads numpy-2 arrays", hint=f"pip install 'numpy<2' into {sys.prefix} (a virtualenv made with "
            "--system-site-packages keeps a GPU image's torch)")


def backend_directory() -> Path:
    """A backend directory with the python stub for this interpreter (built once, then reused)."""
    check_stub_numpy()
    root = pytriton_root() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ToolMissingError(f"nvidia-pytriton has no python backend stub for Python {version}")
    st = stub.stat()
    target = cache_dir() / "tritonserver" / f"backends-py{version}-{st.st_size}-{st.st_mtime_ns}"
    if not (target / "python" / "triton_python_backend_stub").is_file():
        staging = Path(tempfile.mkdtemp(prefix=".backends-", dir=target.parent if target.parent.exists()
                                        else _mkdir(target.parent)))
        shutil.copytree(root / "backends", staging / "backends")
        shutil.copy2(stub, staging / "backends" / "python" / "triton_python_backend_stub")
        try:
            os.rename(staging / "backends", target)
        except OSError:
            pass  # another process won the race; its copy is identical
        shutil.rmtree(staging, ignore_errors=True)
    from .vllm_runtime import install_backend

    install_backend(target)  # backend: "vllm" models run on forge's own vLLM backend
    return target


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def server_environment() -> dict[str, str]:
    """Environment for tritonserver and the python stubs it starts."""
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")])
    site = pytriton_root().parent
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(site / "nvidia_pytriton.libs")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([p for p in libs if p] + [env.get("LD_LIBRARY_PATH", "")])
    return env


def tritonserver_binary() -> Path:
    binary = os.environ.get("FORGE_TRITONSERVER")
    if binary:
        return Path(binary)
    return pytriton_root() / "tritonserver" / "bin" / "tritonserver"
