"""Fixtures for serving tests: a tiny GPT-2 built with --target python once per session, one shared server.

Repositories are built through the real CLI (``forge build --family gpt --target python``):
the newest engine release (v1.2.1), the newest release's LLM-API layout (``l_`` with ``-o decoupled=false``, ``ls_`` the
default: decoupled, ``li_`` with ``-o stream_interval=3``), the engine
release with ``--decoupled`` (streaming), ``--decoupled -o engine_process=true``
(the engine in a process of its own; ``p1_`` with one sender thread), ``--backend-version v0.5.0`` (UINT32 lengths), ``--backend-version
v0.13.0 -o bls=true`` (tensorrtllm_backend's tools) and seed 000's ``--target hf-pipeline`` model. They are merged into one model repository (different name prefixes)
and served by one real tritonserver for the whole session, which keeps CI time low.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from serve_models import MAX_INPUT_LEN, MAX_SEQ_LEN, make_gpt2  # noqa: E402

ENGINE = "v1.2.1"  # the newest release with engines (preprocessing → tensorrt_llm → postprocessing)

BUILDS = {  # name prefix → extra build arguments (the engine layout of ENGINE unless a --backend-version is given)
    "": [],
    # the newest release: the LLM-API layout, one tensorrt_llm model taking text (not decoupled, and the default:
    # decoupled, streaming)
    "l_": ["--backend-version", "latest", "-o", "decoupled=false"],
    "ls_": ["--backend-version", "latest"],
    "li_": ["--backend-version", "latest", "-o", "stream_interval=3"],  # 3 tokens a streamed response after the first
    # its cancel watcher asks every 10 ms: a tiny model's whole answer takes about 100 ms, the default period
    "s_": ["--decoupled", "-o", "cancellation_check_period_ms=10"],
    # the engine in a process of its own; its cancel watcher asks every poll (5 ms), not every 100 ms
    "p_": ["--decoupled", "-o", "engine_process=true", "-o", "cancellation_check_period_ms=1"],
    # ... with one sender thread, which many streams outpace
    "p1_": ["--decoupled", "-o", "engine_process=true", "-o", "sender_threads=1"],
    "v5_": ["--backend-version", "v0.5.0"],
    "v13_": ["--backend-version", "v0.13.0", "-o", "bls=true"],  # the release of the tool tests, with BLS
    "hf_": ["--target", "hf-pipeline", "--dtype", "float32"],  # seed 000's per-request pipeline model
}


@pytest.fixture(scope="session", autouse=True)
def serve_environment(tmp_path_factory):
    """An isolated forge cache and one CPU thread per python model for the whole session."""
    from forge.testing import serving_environment

    with serving_environment(tmp_path_factory.mktemp("forge-cache")):
        yield


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    """A random-weight GPT-2 (2 layers, hidden 64) with a byte-level BPE tokenizer."""
    return make_gpt2(tmp_path_factory.mktemp("models") / "gpt2-tiny")


def build(model: Path, out: Path, *extra: str) -> Path:
    from forge.cli import main

    argv = ["build", "--family", "gpt", "--model", str(model), "--dtype", "float32", "--out", str(out),
            "--backend-version", ENGINE, *extra]
    if "hf-pipeline" not in extra:  # seed 000's model has no limits of its own to set
        # float32 compute: the answers are compared with transformers in float32 token for token (the
        # default on a CPU with bf16 matmuls is bfloat16, whose rounding flips near-tied greedy tokens)
        argv += ["-o", "compute_dtype=float32"]
        argv += ["--target", "python", "--max-input-len", str(MAX_INPUT_LEN), "--max-seq-len", str(MAX_SEQ_LEN),
                 "--max-batch-size", "8"]
    assert main(argv) == 0, f"forge {' '.join(argv)} failed"
    return out


@pytest.fixture(scope="session")
def repos(tiny_gpt2, tmp_path_factory) -> dict[str, Path]:
    """The built repositories, by name prefix."""
    root = tmp_path_factory.mktemp("repos")
    return {prefix: build(tiny_gpt2, root / (prefix or "plain").rstrip("_"),
                          *(["--name-prefix", prefix] if prefix else []), *extra)
            for prefix, extra in BUILDS.items()}


@pytest.fixture(scope="session")
def merged_repo(repos, tmp_path_factory) -> Path:
    """Every model of the builds in one repository (their names do not clash)."""
    from forge.testing import merge_repositories

    return merge_repositories(repos.values(), tmp_path_factory.mktemp("merged") / "repo")


@pytest.fixture(scope="session")
def server(merged_repo, tmp_path_factory):
    """One real tritonserver serving the merged repository for the session."""
    from forge.server.triton_server import TritonServer

    with TritonServer(merged_repo, log_file=tmp_path_factory.mktemp("logs") / "tritonserver.log",
                      startup_timeout=900.0) as s:
        yield s
