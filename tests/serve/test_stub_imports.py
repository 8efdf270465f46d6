"""What a text model's process (tritonserver's python stub) loads: not the libraries only vision models use."""

from __future__ import annotations

from pathlib import Path


def test_text_model_processes_do_without_torchvision_and_scipy(server):
    """Each would cost every start of the process, and every recovery of a dead one, their import time."""
    from forge.server.processes import python_stubs, session_processes

    stubs = python_stubs(session_processes(server.process.pid))
    assert len(stubs) > 3, stubs
    loaded = {model: [lib for lib in ("/torchvision/", "/scipy/") if lib in Path(f"/proc/{pid}/maps").read_text()]
              for model, pid in stubs.items()}
    assert not any(loaded.values()), {model: libs for model, libs in loaded.items() if libs}
