"""Fixtures of the llava tests: one tiny random LLaVA, built with the real CLI for --target python and served once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_llava import make_llava  # noqa: E402

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

MAX_BATCH = 4
BUILD = ["--target", "python", "--dtype", "float32", "--max-input-len", "64", "--max-seq-len", "128",
         "--max-batch-size", str(MAX_BATCH), "-o", "add_special_tokens=true",
         "-o", "exclude_input_in_output=true", "-o", "compute_dtype=float32"]


@pytest.fixture(scope="session", autouse=True)
def llava_environment(tmp_path_factory):
    """An isolated forge cache and one CPU thread per python model for the whole session."""
    from forge.testing import serving_environment

    with serving_environment(tmp_path_factory.mktemp("forge-cache"), HF_HUB_OFFLINE="1"):
        yield


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> Path:
    """Saved by transformers 5 (key layout ``language_model.model.*``)."""
    return make_llava(tmp_path_factory.mktemp("models") / "llava-tiny")


@pytest.fixture(scope="session")
def tiny_llava_new_keys(tmp_path_factory) -> Path:
    """Key layout ``model.language_model.*``, strategy "full", feature layer -1."""
    return make_llava(tmp_path_factory.mktemp("models") / "llava-full", new_keys=True, strategy="full", layer=-1)


def forge(*argv: str) -> int:
    from forge.cli import main

    return main(list(argv))


@pytest.fixture(scope="session")
def llava_repo(tiny_llava, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("repos") / "llava"
    assert forge("build", "--backend-version", ENGINE, "--family", "llava", "--model", str(tiny_llava), "--out", str(out), *BUILD) == 0
    return out


@pytest.fixture(scope="session")
def served_repo(llava_repo, tiny_llava, tmp_path_factory) -> Path:
    """The plain build, a streaming one (``--decoupled``, models prefixed ``s_``) and one for backend
    v0.13.0 (``v13_``: FP16 prompt table) in one repository."""
    root = tmp_path_factory.mktemp("repos")
    streaming, v13 = root / "llava-stream", root / "llava-v13"
    assert forge("build", "--backend-version", ENGINE, "--family", "llava", "--model", str(tiny_llava), "--out", str(streaming), *BUILD,
                 "--decoupled", "--name-prefix", "s_") == 0
    assert forge("build", "--backend-version", ENGINE, "--family", "llava", "--model", str(tiny_llava), "--out", str(v13), *BUILD,
                 "--backend-version", "v0.13.0", "--name-prefix", "v13_") == 0
    from forge.testing import merge_repositories

    return merge_repositories((llava_repo, streaming, v13), tmp_path_factory.mktemp("merged") / "repo")


@pytest.fixture(scope="session")
def llava_server(served_repo, tmp_path_factory):
    from forge.server.triton_server import TritonServer

    with TritonServer(served_repo, log_file=tmp_path_factory.mktemp("logs") / "tritonserver.log") as server:
        yield server
