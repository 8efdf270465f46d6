"""Fixtures for multi-rank serving: tiny GPT-2 and Llama repositories built at tp 1 and tp 2 through the CLI.

Everything is real: ``forge serve`` starts the ranks with Open MPI's mpirun, the Slurm tests submit
``forge deploy slurm``'s script to a one-node Slurm cluster the fixture starts (slurmcluster.py). The
system packages come from ``scripts/system-packages.sh`` (run by ``make test``); where it could not
install them the tests skip with one line saying so.

Both tensor-parallel and single-rank builds compute in float32 (``-o compute_dtype=float32``): the
ranks' partial sums are added in a different order than one rank's matmul, which bfloat16 rounding
would show within a few tokens; in float32 greedy ids agree.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "serve"))
sys.path.insert(0, str(HERE.parent / "llama"))

from serve_models import make_gpt2  # noqa: E402
from llama_models import make_llama  # noqa: E402

ENGINE = "v1.2.1"  # the newest release with engines; the LLM-API layout has tests of its own

SYSTEM_PACKAGES = "scripts/system-packages.sh (make test runs it; it needs root and apt-get)"


def need_mpirun() -> None:
    if shutil.which("mpirun") is None:
        pytest.skip(f"Open MPI (mpirun) is not installed; {SYSTEM_PACKAGES} installs it")


@pytest.fixture(scope="session", autouse=True)
def multirank_environment(tmp_path_factory):
    """An isolated forge cache and one torch thread per rank (two ranks share the machine's cores)."""
    from forge.testing import serving_environment

    with serving_environment(tmp_path_factory.mktemp("forge-cache")):
        yield


def build(family: str, model: Path, out: Path, *extra: str) -> Path:
    from forge.cli import main

    argv = ["build", "--backend-version", ENGINE, "--family", family, "--model", str(model), "--target", "python", "--dtype", "float32",
            "-o", "compute_dtype=float32", "--max-batch-size", "4", "--out", str(out), *extra]
    assert main(argv) == 0, f"forge {' '.join(argv)} failed"
    return out


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"gpt": make_gpt2(root / "gpt2"),
            # 8 heads over 2 KV heads: grouped-query attention split over the ranks
            "llama": make_llama(root / "llama", tokenizer=True)}


@pytest.fixture(scope="session")
def repos(models, tmp_path_factory) -> dict[str, Path]:
    """``gpt-tp2``, ``llama-tp2`` (plain names) and ``gpt-tp1``, ``llama-tp1`` (names prefixed ``gpt_``/``llama_``)."""
    root = tmp_path_factory.mktemp("repos")
    limits = ["--max-input-len", "32", "--max-seq-len", "64"]
    built = {}
    for family in ("gpt", "llama"):
        built[f"{family}-tp2"] = build(family, models[family], root / f"{family}-tp2", "--tp", "2", *limits)
        built[f"{family}-tp1"] = build(family, models[family], root / f"{family}-tp1", "--name-prefix",
                                       f"{family}_", *limits)
    return built


@pytest.fixture(scope="session")
def single_rank_repo(repos, tmp_path_factory) -> Path:
    """The tp 1 builds of both families in one repository, served once for the reference answers."""
    out = tmp_path_factory.mktemp("tp1") / "repo"
    out.mkdir()
    for family in ("gpt", "llama"):
        for model_dir in repos[f"{family}-tp1"].iterdir():
            if model_dir.is_dir():
                shutil.copytree(model_dir, out / model_dir.name)
    return out


CURL_BODY = {"text_input": "What is machine learning?", "max_tokens": 20, "bad_words": "", "stop_words": ""}
PROMPTS = ("What is machine learning?", "hello world")


def ask(http_url: str, model: str, prompt: str, max_tokens: int = 20) -> str:
    """The seed's curl: POST /v2/models/<model>/generate; the generated text."""
    from forge.clients.inference import text_of
    from forge.clients.triton_http import generate

    body = {**CURL_BODY, "text_input": prompt, "max_tokens": max_tokens}
    return text_of(generate(http_url, model, body, timeout=120)["text_output"])


@pytest.fixture(scope="session")
def reference(single_rank_repo) -> dict[str, dict[str, str]]:
    """family → prompt → the answer of the single-rank (tp 1) build, served by one tritonserver."""
    from forge.server.triton_server import TritonServer

    with TritonServer(single_rank_repo, startup_timeout=600) as server:
        return {family: {p: ask(server.http_url, f"{family}_ensemble", p) for p in PROMPTS}
                for family in ("gpt", "llama")}


def leftovers(repo: Path) -> list[str]:
    """``PID: command`` of each live process serving from ``repo`` (ranks, stubs, followers, mpirun)."""
    from forge.server.processes import describe_process, repository_processes

    return [describe_process(pid) for pid in repository_processes(repo)]
