"""Fixtures for ``forge deploy k8s``: tiny GPT-2 repositories of each layout, built through the CLI once.

``tp1`` (one rank), ``tp2`` (a tensor-parallel python model on one node), ``tp4`` (four ranks: two nodes of two
GPUs), ``llmapi`` (the newest release's LLM-API layout, python target) and ``llmapi-tp4pp2`` (the LLM-API layout
for TensorRT-LLM itself, tp 4 × pp 2: eight GPUs, two nodes of four). Building them takes seconds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "serve"))

from serve_models import make_gpt2  # noqa: E402

ENGINE = "v1.2.1"  # the newest release with engines: its NGC container is the default image's base

BUILDS = {
    "tp1": ["--target", "python", "--backend-version", ENGINE],
    "tp2": ["--target", "python", "--backend-version", ENGINE, "--tp", "2"],
    "tp4": ["--target", "python", "--backend-version", ENGINE, "--tp", "4"],
    "llmapi": ["--target", "python", "--backend-version", "latest"],
    "llmapi-tp4pp2": ["--target", "tensorrtllm", "--backend-version", "latest", "--tp", "4", "--pp", "2"],
}


@pytest.fixture(scope="session", autouse=True)
def deploy_environment(tmp_path_factory):
    from forge.testing import serving_environment

    with serving_environment(tmp_path_factory.mktemp("forge-cache")):
        yield


@pytest.fixture(scope="session")
def repos(tmp_path_factory) -> dict[str, Path]:
    from forge.cli import main

    root = tmp_path_factory.mktemp("repos")
    model = make_gpt2(root / "gpt2")
    built = {}
    for name, extra in BUILDS.items():
        argv = ["build", "--family", "gpt", "--model", str(model), "--dtype", "float32", "--max-input-len", "32",
                "--max-seq-len", "64", "--max-batch-size", "4", "--out", str(root / name), *extra]
        assert main(argv) == 0, f"forge {' '.join(argv)} failed"
        built[name] = root / name
    return built
